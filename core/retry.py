"""Bounded retries with exponential backoff and jitter, for calls to a remote service.

    from draftsmith.core.retry import Backoff, Transient, call, retryable_status, retry_after_s

    def once():
        r = client.post(...)
        if retryable_status(r.status_code):
            raise Transient(f"HTTP {r.status_code}", retry_after=retry_after_s(r.headers.get("Retry-After")))
        return r

    reply = call(once, Backoff(retries=4, base_s=1.0, max_s=30.0))  # raises the last Transient when all tries fail

`fn` decides what is worth another try by raising `Transient`; anything else it raises goes through at
once (a request the server refused will not get better). Used by data-gen's OpenAI-compatible backend
(data_gen/regenerate.py); nothing here knows HTTP beyond the status classes and the Retry-After header.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


def retryable_status(status: int) -> bool:
    """408 (request timeout), 429 (too many requests) and every 5xx: the same request may succeed later."""
    return status in (408, 429) or 500 <= status < 600


def retry_after_s(value: Optional[str], now: Optional[float] = None) -> Optional[float]:
    """Seconds a Retry-After header asks to wait (delta-seconds or an HTTP date); None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
        return max(0.0, seconds)
    return seconds if seconds >= 0 and seconds == seconds else None  # (NaN is not a wait)


@dataclass(frozen=True)
class Backoff:
    """How often and how long to wait: `retries` tries after the first; retry r waits a uniformly drawn
    share of min(max_s, base_s * 2**(r-1)) between a half and all of it ("equal jitter": spread out,
    yet never near zero), at least the server's Retry-After, and never more than max_s."""

    retries: int = 4
    base_s: float = 1.0
    max_s: float = 30.0

    def delay(self, retry: int, retry_after: Optional[float] = None, rng=random) -> float:
        """Seconds to wait before retry number `retry` (1 = the first retry)."""
        top = min(self.max_s, self.base_s * 2.0 ** max(0, retry - 1))
        wait = top / 2 + rng.uniform(0, top / 2)
        if retry_after is not None:
            wait = max(wait, retry_after)
        return min(self.max_s, wait)


class Transient(Exception):
    """A failure worth another try. `reason`: one phrase for people ("HTTP 503: overloaded", "timed out
    after 30 s"); `retry_after`: seconds the server asked to wait, if it did; `attempts`: tries made,
    set by `call` when it gives up."""

    def __init__(self, reason: str, retry_after: Optional[float] = None):
        super().__init__(reason)
        self.reason, self.retry_after, self.attempts = reason, retry_after, 1


def call(fn: Callable[[], T], backoff: Backoff, *, sleep: Callable[[float], None] = time.sleep,
         on_retry: Optional[Callable[[int, Transient, float], None]] = None, rng=random) -> T:
    """fn() until it returns, raises something other than Transient, or has failed 1 + backoff.retries
    times (then the last Transient is raised, its `attempts` set). `on_retry(retry, error, wait_s)` is
    called before each wait."""
    retry = 0
    while True:
        try:
            return fn()
        except Transient as e:
            e.attempts = retry + 1
            if retry >= backoff.retries:
                raise
            retry += 1
            wait = backoff.delay(retry, e.retry_after, rng)
            if on_retry is not None:
                on_retry(retry, e, wait)
            sleep(wait)
