"""Progress for long work: a tqdm bar on a terminal, plain lines at a steady interval elsewhere.

A cluster job's log is not a terminal, and tqdm either stays silent there (`disable=None`) or
fills it with carriage returns. So when stderr is not a terminal, `progress` logs one line (logging, INFO: the
stage speaks during long work, the CLI's logging shows it) every `DRAFTSMITH_PROGRESS_INTERVAL` seconds (default
30) and one at the end; a timer logs it even while one long item (a 3000-token answer) is still running:

    regenerate: 120/480 (25%), 3.1 prompt/s, ETA 1m56s

    with progress(total=len(prompts), desc="regenerate", unit="prompt") as bar:
        bar.update(1)
    for x in progress(items, desc="eval", unit="prompt"):
        ...
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Iterable, Optional, Sized

from tqdm import tqdm

log = logging.getLogger(__name__)


def _interval() -> float:
    try:
        return float(os.environ.get("DRAFTSMITH_PROGRESS_INTERVAL", "30"))
    except ValueError:
        return 30.0


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class PlainProgress:
    """tqdm's small interface (update, set_postfix_str, close, iteration, context manager) as log lines."""

    def __init__(self, iterable: Optional[Iterable] = None, total: Optional[int] = None, desc: str = "",
                 unit: str = "it", initial: int = 0, interval: Optional[float] = None):
        self.iterable, self.desc, self.unit = iterable, desc, unit
        if total is None and isinstance(iterable, Sized):
            total = len(iterable)
        self.total, self.n, self.start_n = total, initial, initial
        self.interval = _interval() if interval is None else interval
        self.postfix = ""
        self.t0 = self.last = time.monotonic()
        self.closed = False
        self.shown_n: Optional[int] = None  # n of the last line logged
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if self.interval > 0:  # steady lines even when no update comes for a while
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self._stop.wait(self.interval / 2):
            if time.monotonic() - self.last >= self.interval:
                self._emit()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = (self.n - self.start_n) / elapsed
        done = f"{self.n}/{self.total} ({100 * self.n / self.total:.0f}%)" if self.total else f"{self.n}"
        eta = ""
        if self.total and rate > 0 and self.n < self.total:
            eta = f", ETA {_duration((self.total - self.n) / rate)}"
        post = f", {self.postfix}" if self.postfix else ""
        return f"{self.desc}: {done}, {rate:.3g} {self.unit}/s, elapsed {_duration(elapsed)}{eta}{post}"

    def _emit(self) -> None:
        with self._lock:
            log.info(self.line())
            self.last, self.shown_n = time.monotonic(), self.n

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.interval:
            self._emit()

    def set_postfix_str(self, s: str, refresh: bool = True) -> None:
        self.postfix = s

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._stop.set()
            if self.shown_n != self.n:  # the final count, unless the last line already showed it
                self._emit()

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Silent(PlainProgress):
    def _emit(self) -> None:
        pass


def progress(iterable: Optional[Iterable] = None, total: Optional[int] = None, desc: str = "", unit: str = "it",
             initial: int = 0, enabled: bool = True, leave: bool = False):
    """A tqdm bar when stderr is a terminal, else a PlainProgress; nothing at all when not `enabled`."""
    if not enabled:
        return _Silent(iterable, total, desc, unit, initial)
    if sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, leave=leave, dynamic_ncols=True)
    return PlainProgress(iterable, total, desc, unit, initial)
