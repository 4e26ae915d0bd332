"""The results file: JSON lines appended and flushed one at a time while the job runs, so a killed
job loses at most the lines of the batch in flight, and rewritten in input order (by `line`) when the
job ends, so the file does not depend on batching, sorting or the number of processes.

On start the file is read back: a last line without its newline (a write cut by a kill) is cut off,
and the ids and line numbers already present are what a restarted job skips.
"""

from __future__ import annotations

import json
import os


def load_records(path: str) -> list[dict]:
    """The complete, valid JSON object lines of `path` (none when it does not exist)."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for text in f:
            if not text.endswith("\n"):
                break  # a partial last line
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("line"), int):
                records.append(record)
    return records


def repair(path: str) -> None:
    """Cuts a partial last line (anything after the last newline)."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            f.truncate(keep)


class Done:
    """What a restarted job skips: requests whose id has a result, and lines whose error is recorded."""

    def __init__(self, records: list[dict]):
        self.ids = {_key(r["id"]) for r in records if "error" not in r and "id" in r}
        self.lines = {r["line"] for r in records}

    def has(self, request_id) -> bool:
        return _key(request_id) in self.ids

    def to_json(self) -> str:
        return json.dumps({"ids": sorted(self.ids), "lines": sorted(self.lines)})

    @classmethod
    def from_json(cls, text: str) -> "Done":
        obj, done = json.loads(text), cls([])
        done.ids, done.lines = {tuple(k) for k in obj["ids"]}, set(obj["lines"])
        return done


def _key(request_id) -> tuple:
    return (type(request_id).__name__, request_id)  # the id 5 and the id "5" are different requests


class ResultsWriter:
    """Appends records line by line (process 0 only)."""

    def __init__(self, path: str):
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        repair(path)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def write(self, records: list[dict]) -> None:
        for record in records:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._file.close()

    def finalize(self) -> int:
        """Rewrites the file in input order (one record per line number, the first written kept),
        atomically; returns the number of records."""
        self.close()
        by_line: dict[int, dict] = {}
        for record in load_records(self.path):
            by_line.setdefault(record["line"], record)
        partial = f"{self.path}.sorting"
        with open(partial, "w", encoding="utf-8") as f:
            for line in sorted(by_line):
                f.write(json.dumps(by_line[line]) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, self.path)
        return len(by_line)
