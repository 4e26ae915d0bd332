"""The import arrows of ARCHITECTURE.md ("Packages and arrows"), enforced.

Every module of the repository is parsed with `ast` (nothing is imported), each of its imports,
module-level or inside a function, is mapped to the unit it lands in, and an import from one unit
into another that UNITS_MAY_IMPORT does not list fails, unless EXCEPTIONS names that exact pair.
The tables below are the architecture; ARCHITECTURE.md mirrors them. Imports made through
`importlib` with a string (k3jax/__init__.py's lazy re-exports of serve.LLM and serve.SamplingParams)
are not seen here: they are the one arrow into serve/ that k3jax's package face takes on purpose.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("benchmarks", "convert", "k3jax", "pallas_kernels", "serve", "sharding", "tests")

# unit -> the module prefixes it owns; a module belongs to the unit of its longest matching prefix.
UNITS = {
    "mxfp4_format": ("pallas_kernels.mxfp4_format",),
    "kernels": ("pallas_kernels",),
    "sharding": ("sharding",),
    "config": ("k3jax.config", "k3jax.presets", "k3jax.dspark.config", "k3jax.vision.config"),
    "convert": ("convert",),
    "layers": ("k3jax.layers",),
    "model": ("k3jax",),
    # The eval job's parts that read, batch, score and write; the rest of k3jax/eval/ (the package face,
    # __main__, job, generate) is the job itself, "eval".
    "eval_parts": ("k3jax.eval.batching", "k3jax.eval.multihost", "k3jax.eval.output", "k3jax.eval.progress",
                   "k3jax.eval.requests", "k3jax.eval.scoring"),
    "eval": ("k3jax.eval",),
    "train": ("k3jax.train",),
    "serve": ("serve",),
    "entry": ("k3jax.serve",),
    "benchmarks": ("benchmarks",),
    "tests": ("tests",),
}

# The allowed arrows, unit -> the other units it may import (its own is always allowed). Arrows point
# down: kernels and sharding know nothing of the model, the model nothing of serving, and convert
# sees only the configuration modules (so k3jax.loading can use convert's readers without a cycle).
_BELOW_SERVE = {"model", "layers", "config", "sharding", "convert"}
UNITS_MAY_IMPORT = {
    "mxfp4_format": set(),
    "kernels": {"mxfp4_format", "sharding"},  # the mesh axis names (sharding.mesh), for shard_map
    "sharding": set(),
    "config": {"mxfp4_format"},
    "convert": {"config", "mxfp4_format"},
    "layers": {"config", "kernels", "mxfp4_format", "sharding"},
    "model": {"layers", "config", "kernels", "mxfp4_format", "sharding", "convert"},
    "eval_parts": {"model", "layers", "config", "kernels", "mxfp4_format", "sharding", "convert"},
    "serve": _BELOW_SERVE,
    # Applications above serve/: the server's command line (python -m k3jax.serve), the batch eval job
    # (python -m k3jax.eval), whose generate task runs the serving engine, and training.
    "entry": {"serve"} | _BELOW_SERVE,
    "eval": {"serve", "eval_parts"} | _BELOW_SERVE,
    # Training the embedded model (python -m k3jax.train): its corpus is rendered by serve/chat's
    # prompt encoder, and its replies are measured through the engine.
    "train": {"serve"} | _BELOW_SERVE,
    "benchmarks": set(UNITS) - {"tests"},
    "tests": set(UNITS),
}

# Third-party packages the lowest units may use (the standard library is always allowed): the
# kernels and the mesh code run on jax alone, and the configuration modules import no jax at all.
THIRD_PARTY = {
    "mxfp4_format": {"numpy"},
    "kernels": {"jax", "numpy"},
    "sharding": {"jax", "numpy"},
    "config": set(),
}

# Imports allowed to break an arrow, each (importing module, imported module) -> the issue that removes
# it; none today. A new broken arrow fails the test; an entry no import needs any more fails it too.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py file of the packages (a package is its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def unit_of(module: str) -> str | None:
    best, unit = -1, None
    for name, prefixes in UNITS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, unit = len(prefix), name
    return unit


def imports(module: str, path: pathlib.Path, known: dict) -> list[str]:
    """The modules `module` imports: `from a import b` is a.b when that is a module of the repository."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb level - 1 packages from this module's package
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found += [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    return found


def broken_arrows(known: dict) -> tuple[list[str], set]:
    """(one line per forbidden import, the EXCEPTIONS entries that were used)."""
    broken, used = [], set()
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for module, path in known.items():
        source = unit_of(module)
        for target in imports(module, path, known):
            top = target.split(".")[0]
            if top not in PACKAGES:
                allowed = THIRD_PARTY.get(source)
                if allowed is not None and top not in stdlib and top not in allowed:
                    broken.append(f"{module} imports {target}: {source} may use only {sorted(allowed) or 'the standard library'}")
                continue
            dest = unit_of(target)
            if dest == source or dest in UNITS_MAY_IMPORT[source]:
                continue
            if (module, target) in EXCEPTIONS:
                used.add((module, target))
                continue
            broken.append(f"{module} imports {target}: {source} -> {dest} is not an arrow of ARCHITECTURE.md")
    return broken, used


def test_every_module_belongs_to_a_unit():
    assert [m for m in modules() if unit_of(m) is None] == []


def test_imports_follow_the_arrows():
    broken, _ = broken_arrows(modules())
    assert broken == [], "\n".join(broken)


def test_every_exception_is_still_needed():
    _, used = broken_arrows(modules())
    assert sorted(set(EXCEPTIONS) - used) == [], "remove these EXCEPTIONS entries: nothing imports them any more"
