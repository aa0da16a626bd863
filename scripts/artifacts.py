"""Artifacts (`draftsmith.artifacts`): manifests, atomic writes and output-folder ownership, used by
every stage, so it lives in the package root beside the CLI and the method table.

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


def current_umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def default_mode(folder: bool) -> int:
    """What a plain open() / mkdir() would give under the user's umask (0644 / 0755 under umask 022)."""
    return (0o777 if folder else 0o666) & ~current_umask()


def give_default_modes(folder: Path) -> None:
    """Give `folder` and everything in it the modes plain mkdir() / open() would have under the umask."""
    dir_mode, file_mode = default_mode(folder=True), default_mode(folder=False)
    os.chmod(folder, dir_mode)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), dir_mode)
        for f in files:
            if not os.path.islink(os.path.join(root, f)):
                os.chmod(os.path.join(root, f), file_mode)


def write_error(path: str | os.PathLike, e: OSError) -> DraftsmithError:
    """An OSError while writing (disk full, read-only file system, no permission) as one sentence."""
    reason = e.strerror or str(e) or type(e).__name__
    return DraftsmithError(f"could not write {path}: {reason}; nothing there was replaced.")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary name in the same folder, then rename: a reader never sees half a file.

    An OSError (disk full, ...) becomes one DraftsmithError naming `path`; the temporary name goes.
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600; give the file the permissions a plain open() would have.
        os.chmod(tmp, default_mode(folder=False))
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise write_error(path, e) from e
        raise


@contextlib.contextmanager
def atomic_folder(folder: str | os.PathLike, owner: str | None = None) -> Iterator[Path]:
    """Yield a hidden temporary sibling of `folder`; on success it replaces `folder`, on error it goes.

    An existing `folder` is moved aside only after the new one is complete, then removed; if the
    swap fails it is put back. With `owner` (a stage name) an existing non-empty `folder` that is
    not that stage's own output is refused before anything is written. An OSError (disk full, ...)
    becomes one DraftsmithError naming `folder`.
    """
    folder = Path(folder)
    if owner is not None and folder.is_dir() and not is_empty(folder) and not owns(folder, owner):
        raise not_owned_error(folder, owner)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    except OSError as e:
        raise write_error(folder, e) from e
    old = None
    try:
        yield tmp
        give_default_modes(tmp)  # mkdtemp makes 0700 (and some writers 0600): nobody else could read it
        if folder.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".old", dir=folder.parent))
            os.replace(folder, old / folder.name)
        try:
            os.replace(tmp, folder)
        except BaseException:
            if old is not None and (old / folder.name).exists():
                os.replace(old / folder.name, folder)  # put the earlier output back
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not (old / folder.name).exists():
            shutil.rmtree(old, ignore_errors=True)
        if isinstance(e, OSError):
            raise write_error(folder, e) from e
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
    except (OSError, UnicodeDecodeError) as e:
        raise DraftsmithError(f"{path} could not be read: {getattr(e, 'strerror', None) or e}.") from None
    if not isinstance(manifest, dict):
        raise DraftsmithError(f"{path} is not a draftsmith manifest: it holds a JSON {json_kind(manifest)}, "
                              f"not an object.")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise DraftsmithError(
            f"{path} has schema_version {manifest.get('schema_version')!r}; this draftsmith reads {SCHEMA_VERSION}."
        )
    return manifest


def json_kind(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def check_same_target(manifest_target: dict, target: dict, where: str) -> None:
    """Refuse an artifact made for another target, tokenizer or hidden size, naming the field."""
    for field in IDENTITY_FIELDS:
        have, want = manifest_target.get(field), target.get(field)
        if have != want:
            raise DraftsmithError(
                f"{where} was made for target {manifest_target.get('target_id')!r} "
                f"({field}={have!r}), not for {target.get('target_id')!r} ({field}={want!r})."
            )


# ---------------------------------------------------------------------------------------------
# Outputs: a stage writes only into a new folder, an empty one, or its own earlier output.

OWNER = ".draftsmith_owner.json"  # {"stage": ...}: written into an out folder before a stage's first write
STAGE_NAMES = {"data_gen": "data-gen", "train": "train", "eval": "eval", "export": "export", "demo": "demo",
               "publish": "publish"}
OWNER_WORDS = {
    "data_gen": "data-gen's output", "train": "a training run", "eval": "an eval report",
    "export": "an exported head", "demo": "a demo run", "publish": "a publish folder", "train_head": "a trained head (train's final/ folder)",
}
# Outputs made before owner files existed, recognised by what their stage always writes.
LEGACY_SIGNS = {
    "train": ("checkpoints/", "final/manifest.json"),
    "demo": ("data_gen.done.json", "train.done.json", "eval.done.json", "demo_summary.json"),
    "data_gen": (".data_gen_counts.json", "parts/", "regenerated/"),
}


def _read_json_object(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def is_empty(folder: Path) -> bool:
    """True for a folder holding nothing but (the temporary names of) an owner file."""
    return all(p.name == OWNER or p.name.startswith(f".{OWNER}.") for p in folder.iterdir())


def owner_of(folder: str | os.PathLike) -> str | None:
    """The stage whose output `folder` is (its owner file, else its manifest, else legacy signs), or None."""
    folder = Path(folder)
    owner = _read_json_object(folder / OWNER)
    if owner is not None and isinstance(owner.get("stage"), str):
        return owner["stage"]
    manifest = _read_json_object(folder / MANIFEST)
    if manifest is not None and isinstance(manifest.get("produced_by"), dict):
        stage = manifest["produced_by"].get("stage")
        if isinstance(stage, str):
            return "train_head" if stage == "train" else stage  # train's own manifest lives in final/
    for stage, signs in LEGACY_SIGNS.items():
        for sign in signs:
            if sign.endswith("/") and (folder / sign).is_dir():
                return stage
            if sign == "final/manifest.json":
                m = _read_json_object(folder / sign)
                if m is not None and isinstance(m.get("produced_by"), dict) and m["produced_by"].get("stage") == "train":
                    return stage
            elif not sign.endswith("/") and (folder / sign).is_file():
                return stage
    return None


def owns(folder: str | os.PathLike, stage: str) -> bool:
    return owner_of(folder) == stage


def not_owned_error(out: Path, stage: str) -> DraftsmithError:
    owner = owner_of(out)
    name = STAGE_NAMES.get(stage, stage)
    what = OWNER_WORDS.get(owner, f"{owner}'s output") if owner else f"files draftsmith {name} did not write"
    return DraftsmithError(f"out={out} already holds {what}; {name} writes only into a new or empty folder or its "
                           f"own earlier output, so choose another out (or pass overwrite=true to write there anyway).")


def _inside(path: Path, folder: Path) -> bool:
    return folder in path.parents


def prepare_output(out, stage: str, inputs=(), overwrite: bool = False) -> Path:
    """Check `out` before a stage does any work; returns it as a Path. Writes nothing.

    Accepted: a folder that does not exist, an empty one, or `stage`'s own earlier output; anything
    else only with `overwrite`. Always refused: an existing file, the current folder (or one above
    it), the home folder, and a folder that is, contains or lies inside one of `inputs`
    ((option name, path) pairs the stage reads), overwrite or not.
    """
    if out is None or str(out) in ("", "???"):
        raise DraftsmithError(f"out= is not set: pass out=<a new folder> for draftsmith {STAGE_NAMES.get(stage, stage)}.")
    out = Path(str(out))
    real = Path(os.path.realpath(out))
    cwd = Path(os.path.realpath(os.getcwd()))
    if real == cwd or _inside(cwd, real):
        where = "is the current folder" if real == cwd else "holds the current folder"
        raise DraftsmithError(f"out={out} {where}; give the output a folder of its own, e.g. out=runs/{stage}.")
    if real == Path(os.path.realpath(Path.home())) or real == Path(real.anchor):
        raise DraftsmithError(f"out={out} is your home or root folder; give the output a folder of its own, "
                              f"e.g. out=runs/{stage}.")
    if os.path.lexists(out) and not out.is_dir():
        kind = "a broken link" if not out.exists() else "an existing file"
        raise DraftsmithError(f"out={out} is {kind}, not a folder; choose a folder for the output.")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise DraftsmithError(f"out={out} cannot be made: {parent} is a file, not a folder.")
            break
    for label, path in inputs:
        if path is None or str(path) in ("", "???") or not os.path.lexists(str(path)):
            continue  # (a hub id, or an input that is not there: nothing of it to destroy)
        inp = Path(os.path.realpath(str(path)))
        if inp == real:
            where = f"is the {label} folder"
        elif _inside(inp, real):
            where = f"contains the {label} {path}"
        elif _inside(real, inp):
            where = f"is inside the {label} folder {path}"
        else:
            continue
        raise DraftsmithError(f"out={out} {where}, which {STAGE_NAMES.get(stage, stage)} reads; choose a folder "
                              f"apart from it (overwrite=true does not change this).")
    if out.is_dir() and not overwrite and not is_empty(out) and not owns(out, stage):
        raise not_owned_error(out, stage)
    return out


def claim_output(out: str | os.PathLike, stage: str) -> Path:
    """Create `out` (checked by prepare_output) and mark it as `stage`'s output, before the stage's first write."""
    out = Path(out)
    atomic_write_json(out / OWNER, {"stage": stage, "tool": "draftsmith", "version": __version__})
    return out
