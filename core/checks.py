"""Option checks the config dataclasses run in `__post_init__`: each failure is one sentence naming the
option and what it allows (draftsmith.configs.check_config runs them when a stage's config is built)."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from . import DraftsmithError


def at_least(name: str, value, low, *, null: Optional[str] = None) -> None:
    """value >= low; `null` (what None means) allows None."""
    if value is None and null is not None:
        return
    if value is None or value < low:
        also = f" (or null for {null})" if null is not None else ""
        raise DraftsmithError(f"{name}={_show(value)} must be at least {low}{also}.")


def positive(name: str, value, *, null: Optional[str] = None) -> None:
    """value > 0; `null` (what None means) allows None."""
    if value is None and null is not None:
        return
    if value is None or not value > 0:
        also = f" (or null for {null})" if null is not None else ""
        raise DraftsmithError(f"{name}={_show(value)} must be greater than 0{also}.")


def in_range(name: str, value, low, high, *, low_open: bool = False, high_open: bool = False,
             note: str = "") -> None:
    """low <= value <= high, either end open on request."""
    ok = value is not None and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise DraftsmithError(f"{name}={_show(value)} must be in {interval}{note}.")


def one_of(name: str, value, choices: Iterable[str]) -> None:
    choices = list(choices)
    if value not in choices:
        raise DraftsmithError(f"{name}={_show(value)} is not one of {', '.join(choices)}.")


def device(name: str, value: str) -> None:
    """A torch device string that this machine has: `cuda` needs torch.cuda.is_available()."""
    try:
        kind = torch.device(value).type
    except (RuntimeError, TypeError, ValueError):
        raise DraftsmithError(f"{name}={_show(value)} is not a torch device (cpu, cuda, cuda:<index>, mps).") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise DraftsmithError(f"{name}={value} was asked for but this machine has no CUDA device "
                              "(torch.cuda.is_available() is False).")
    if kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise DraftsmithError(f"{name}={value} was asked for but this machine has no MPS device "
                              "(torch.backends.mps.is_available() is False).")


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
