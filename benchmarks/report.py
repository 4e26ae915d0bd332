"""Printing a benchmark table and writing its JSON next to the other results."""

from __future__ import annotations

import datetime
import json
import os
import platform

import jax

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


def report(name: str, rows: list[dict], note: str = "") -> str:
    """Prints rows as an aligned table and writes benchmarks/results/<name>.json; returns the path."""
    columns = list(rows[0])
    cells = [[_fmt(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print(f"\n{name}" + (f"  ({note})" if note else ""))
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    meta = {"date": datetime.date.today().isoformat(), "jax": jax.__version__, "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind, "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "note": note}
    with open(path, "w") as f:
        json.dump({"benchmark": name, "meta": meta, "rows": rows}, f, indent=2)
    return path


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
