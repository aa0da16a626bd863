"""Artifact manifests and atomic writes shared by every stage.

Every artifact is a folder with `manifest.json`: schema version, the stage that produced it,
the target's identity (id, hash, tokenizer hash, sizes) and counts. A stage checks its input's
manifest against the target it runs with and refuses a mismatch with one sentence.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from draftsmith import DraftsmithError, __version__

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"

# Target fields two artifacts must agree on to be used together.
IDENTITY_FIELDS = ("target_hash", "tokenizer_hash", "hidden_size", "vocab_size")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary name in the same folder, then rename: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; give the file the permissions a plain open() would have.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Yield a hidden temporary sibling of `folder`; on success it replaces `folder`, on error it goes.

    An existing `folder` is moved aside only after the new one is complete, then removed.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        yield tmp
        old = None
        if folder.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".old", dir=folder.parent))
            os.replace(folder, old / folder.name)
        os.replace(tmp, folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def write_manifest(folder: str | os.PathLike, stage: str, target: dict, counts: dict, **extra: Any) -> dict:
    """Write `folder/manifest.json` atomically and return it."""
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "produced_by": {"tool": "draftsmith", "version": __version__, "stage": stage},
        "target": target,
        "counts": counts,
        **extra,
    }
    atomic_write_json(Path(folder) / MANIFEST, manifest)
    return manifest


def read_manifest(folder: str | os.PathLike) -> dict:
    """Read a folder's manifest; one clear sentence if it is missing or unreadable."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise DraftsmithError(f"{folder} is not a draftsmith artifact: it has no {MANIFEST}.")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{path} is not valid JSON (line {e.lineno}): {e.msg}.") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise DraftsmithError(
            f"{path} has schema_version {manifest.get('schema_version')!r}; this draftsmith reads {SCHEMA_VERSION}."
        )
    return manifest


def check_same_target(manifest_target: dict, target: dict, where: str) -> None:
    """Refuse an artifact made for another target, tokenizer or hidden size, naming the field."""
    for field in IDENTITY_FIELDS:
        have, want = manifest_target.get(field), target.get(field)
        if have != want:
            raise DraftsmithError(
                f"{where} was made for target {manifest_target.get('target_id')!r} "
                f"({field}={have!r}), not for {target.get('target_id')!r} ({field}={want!r})."
            )
