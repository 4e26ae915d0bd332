"""A progress line on stderr: done / total, examples per second and the time left.

On a terminal the line is redrawn in place (at most 5 times a second); in a log file a new line is
written every 30 seconds, so a day-long job does not write a megabyte of progress.
"""

from __future__ import annotations

import sys
import time


def log(message: str) -> None:
    print(f"k3jax.eval: {message}", file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total: int, label: str, *, stream=None, enabled: bool = True):
        self.total, self.label, self.done = total, label, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 0.2 if self.tty else 30.0
        self.start = self._last = time.monotonic()
        self._drawn = -1  # the count last drawn

    def rate(self) -> float:
        elapsed = time.monotonic() - self.start
        return self.done / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        rate = self.rate()
        percent = 100.0 * self.done / self.total if self.total else 100.0
        eta = _clock((self.total - self.done) / rate) if rate > 0 else "?"
        return f"{self.label}: {self.done}/{self.total} ({percent:.0f}%)  {rate:.1f} ex/s  ETA {eta}"

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= self.interval or self.done >= self.total):
            self._last = now
            self._draw()

    def _draw(self) -> None:
        self._drawn = self.done
        if self.tty:
            self.stream.write("\r" + self.line() + "\033[K")
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            if self._drawn != self.done:
                self._draw()
            if self.tty:
                self.stream.write("\n")
            self.stream.flush()
