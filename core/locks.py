"""Infrastructure the stages share to run side by side: the rank environment, files claimed by one live process
(pid, host; a file left by a dead process of this host is taken over), directories claimed once, a wait that gives
up only when nothing changes, and the scan for build locks a killed DeepSpeed op build left behind."""

from __future__ import annotations

import json
import os
import logging
import socket
import time
from pathlib import Path
from typing import Callable, Optional

from torch.utils.cpp_extension import get_default_build_root

from . import DraftsmithError

log = logging.getLogger(__name__)


def rank_world() -> tuple[int, int]:
    """(rank, world_size) from the torchrun environment; (0, 1) without it."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise DraftsmithError(f"RANK={rank} is outside WORLD_SIZE={world}.")
    return rank, world


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def claim_file(path: Path) -> Path | None:
    """Create `path` (pid, host) atomically; None when another live process holds it. A file left by a
    dead process of this host is taken over (one on another host cannot be checked: it is respected)."""
    my_host = socket.gethostname()
    me = {"pid": os.getpid(), "host": my_host}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
                pid, host = int(holder["pid"]), str(holder["host"])
            except FileNotFoundError:
                continue
            except (ValueError, KeyError, TypeError):  # being written, or its writer died before writing it
                if time.time() - path.stat().st_mtime < 10:
                    return None
                pid, host = -1, my_host
            if host == my_host and (pid <= 0 or not pid_alive(pid)):
                path.unlink(missing_ok=True)
                continue
            return None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return path
    return None


def acquire_lock(path: Path, stage: str) -> Path:
    """Claim `path` (pid, host) for this run of `stage` writing to its folder; refuse while a live run holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if claim_file(path) is not None:
        return path
    try:
        holder = json.loads(path.read_text())
        who = f"pid {holder['pid']} on {holder['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        who = "one that is just starting"
    raise DraftsmithError(f"another {stage} ({who}) is writing to {path.parent}; wait for it to finish, or delete "
                          f"{path} if it is no longer running.")


def release_lock(path: Path) -> None:
    """Remove the lock if it is still ours."""
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def claim_dir(path: Path) -> bool:
    """True for the one process that creates the directory `path` (a lock among ranks sharing a folder)."""
    try:
        os.mkdir(path)
    except FileExistsError:
        return False
    return True


def wait_while_progressing(done: Callable[[], bool], signs: Callable[[], tuple], limit_s: float, poll_s: float,
                           note: Callable[[], str], give_up: Callable[[float], str]) -> None:
    """Poll `done()` every `poll_s` seconds, logging `note()` every 5 minutes; raise DraftsmithError(give_up(limit))
    once `signs()` (what changes while the others work) stayed the same for `limit_s` seconds."""
    last, since, noted = signs(), time.monotonic(), time.monotonic()
    while not done():
        now = time.monotonic()
        if now - noted >= 300:
            log.info(note())  # long work: the stage speaks through logging (the CLI shows it)
            noted = now
        new = signs()
        if new != last:
            last, since = new, now
        elif now - since > limit_s:
            raise DraftsmithError(give_up(limit_s))
        time.sleep(poll_s)


def stale_extension_locks(root: Optional[Path] = None, min_age_s: float = 60.0) -> list[Path]:
    """Build locks in torch's extension folder that a killed build left behind.

    DeepSpeed JIT-builds ops (on CPU: deepspeed_shm_comm, cpu_adam) under torch's `FileBaton`: the builder
    creates `<op>/lock` and keeps it open; every other process polls until the file is gone, forever. A lock
    that no process on this machine holds open and that is older than `min_age_s` will never go away."""
    if root is None:
        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    locks = []
    for lock in root.glob("*/*/lock") if root.is_dir() else ():
        try:
            if time.time() - lock.stat().st_mtime > min_age_s:
                locks.append(lock)
        except FileNotFoundError:  # a build that finished between the listing and the stat
            continue
    if not locks or not Path("/proc/self/fd").is_dir():  # no lock, or not Linux: nothing can be told
        return []
    held = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            held.add(Path(os.readlink(fd)))
        except OSError:  # a process or fd that went away, or one we may not read
            continue
    return [p for p in locks if p.resolve() not in held]
