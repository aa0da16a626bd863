"""Artifacts (`draftsmith.core.artifacts`): manifests, atomic writes and output-folder ownership, used by
every stage, so it lives in the core (core/) beside the method table.

Every artifact is a folder with `manifest.json`: schema version, the stage that produced it,
the target's identity (id, hash, tokenizer hash, sizes) and counts. A stage checks its input's
manifest against the target it runs with and refuses a mismatch with one sentence.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from . import DraftsmithError, __version__

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


# ---------------------------------------------------------------------------------------------
# What draftsmith wrote in a folder, so that replacing or removing it never takes a user's file.

RECORD = ".draftsmith_files.json"  # inside a folder atomic_folder wrote: every entry it wrote there
# A temporary of atomic_write_bytes (`.<name>.XXXXXXXX.tmp`) or atomic_folder (`.tmp` / `.old` folders).
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}\.(?P<kind>tmp|old)$")


def _scan(root: Path) -> Iterator[tuple[str, os.DirEntry]]:
    """(relative path, entry) of everything under `root`, each folder before what it holds, never entering a link."""
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(root / rel if rel else root) as it:
                entries = sorted(it, key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            r = f"{rel}/{e.name}" if rel else e.name
            yield r, e
            if e.is_dir(follow_symlinks=False):
                stack.append(r)


def _is_dir(path: Path) -> bool:
    """A real folder (a link to one is not)."""
    return path.is_dir() and not path.is_symlink()


def _parents(rel: str) -> list[str]:
    """'a/b/c' -> ['a', 'a/b']."""
    parts = rel.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def read_record(folder: str | os.PathLike) -> set[str] | None:
    """The relative paths draftsmith wrote in `folder` (its record), or None where it has none."""
    record = _read_json_object(Path(folder) / RECORD)
    files = record.get("written") if record is not None else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return set(files)


def write_record(folder: str | os.PathLike) -> None:
    """Record everything now in `folder` as written by draftsmith (what a later replace or removal may drop)."""
    folder = Path(folder)
    written = [rel for rel, _ in _scan(folder) if rel != RECORD]
    atomic_write_json(folder / RECORD, {"tool": "draftsmith", "written": sorted(written)})


def _unwritten(old: Path, new: Path) -> list[tuple[str, str]]:
    """The entries of `old` draftsmith did not write (its record does not list them; no record: none is it
    wrote), as (relative path, where it would go in `new`): "free", "same" (`new` has that name) or "blocked"
    (`new` has a file where a folder above it would be). An unwritten folder comes whole, unless `new` has a
    folder of that name: then what it holds comes entry by entry."""
    listed = read_record(old) or set()
    found, whole = [], set()
    for rel, entry in _scan(old):
        if rel == RECORD or any(p in whole for p in _parents(rel)):
            continue
        here = new / rel
        is_dir = entry.is_dir(follow_symlinks=False)
        if rel in listed or (is_dir and _is_dir(here)):
            continue  # draftsmith's (or a folder both have): look at what it holds
        if any(os.path.lexists(new / p) and not _is_dir(new / p) for p in _parents(rel)):
            found.append((rel, "blocked"))
        else:
            found.append((rel, "same" if os.path.lexists(here) else "free"))
        if is_dir:
            whole.add(rel)
    return found


def _move(src_root: Path, dst_root: Path, rels: list[str]) -> list[str]:
    """Move each entry from src_root into dst_root (parents made); returns those moved. Links move as links;
    on an error what was moved goes back."""
    moved = []
    try:
        for rel in rels:
            (dst_root / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(src_root / rel, dst_root / rel)
            moved.append(rel)
    except BaseException:
        _move_back(dst_root, src_root, moved)
        raise
    return moved


def _move_back(src_root: Path, dst_root: Path, rels: list[str]) -> None:
    for rel in reversed(rels):
        with contextlib.suppress(OSError):
            os.replace(src_root / rel, dst_root / rel)


def _not_empty(path: Path) -> bool:
    return _is_dir(path) and any(True for _ in os.scandir(path))


def _is_empty_dir(path: Path) -> bool:
    return _is_dir(path) and not _not_empty(path)


def _is_owner_file(rel: str) -> bool:
    """The owner file a stage claims a folder with (export claims the user's folder before its swap)."""
    return "/" not in rel and (rel == OWNER or rel.startswith(f".{OWNER}."))


def replace_folder(new: Path, folder: Path) -> None:
    """Put the complete folder `new` in place of `folder`, keeping every file of `folder` draftsmith did not write.

    `new` gets a record of what it holds; the user's entries of the old `folder` (`_unwritten`) are moved
    into it (one that `new` has under the same name is replaced, unless it is a folder with something in it:
    that is refused), then the two are swapped by rename and what the old folder still holds (what draftsmith
    wrote there before) is removed. On an error everything is put back where it was."""
    write_record(new)
    if not os.path.lexists(folder):
        os.replace(new, folder)
        return
    entries = _unwritten(folder, new) if _is_dir(folder) else []  # (a link or a file at `folder` is replaced)
    for rel, where in entries:
        if where == "blocked" or (where == "same" and _not_empty(folder / rel)):
            raise DraftsmithError(f"{folder / rel} is not draftsmith's, and the new output has a file in its way; "
                                  f"move it elsewhere and rerun.")
        if where == "same" and not _is_owner_file(rel) and not _is_empty_dir(folder / rel):
            # a user's file under a name the new output writes: refused, never replaced (prepare_output refuses
            # the names a stage declares before any work; this catches the rest, e.g. a format's own files)
            raise DraftsmithError(f"{folder / rel} is a file draftsmith did not write, and the new output has a file "
                                  f"of that name; draftsmith never replaces your files, so move or rename it and "
                                  f"rerun.")
    carried = _move(folder, new, [rel for rel, where in entries if where == "free"])
    old = None
    try:
        old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".old", dir=folder.parent))
        os.replace(folder, old / folder.name)  # (a link moves as a link: nothing behind it is touched)
        try:
            os.replace(new, folder)
        except BaseException:
            os.replace(old / folder.name, folder)  # put the earlier output back
            raise
    except BaseException:
        if old is not None and not os.path.lexists(old / folder.name):
            shutil.rmtree(old, ignore_errors=True)
        _move_back(new, folder, carried)
        raise
    shutil.rmtree(old, ignore_errors=True)  # only what draftsmith wrote there before (never behind a link)


def _rescue(stale: Path, folder: Path) -> bool:
    """Move the user's entries of an unfinished new folder (a failed or killed atomic_folder) back into `folder`;
    True when nothing of the user's is left in it. One without a record holds only what draftsmith wrote: the
    record is written before anything of the user's is moved in."""
    if read_record(stale) is None:
        return True
    entries = _unwritten(stale, folder)
    if entries and not _is_dir(folder):
        return False  # (its place is gone: leave it for the user to look at)
    left = False
    for rel, where in entries:
        if where != "free":
            left = True  # something of that name came since: leave it for the user to look at
            continue
        try:
            _move(stale, folder, [rel])
        except OSError:
            left = True
    return not left


def clean_temporaries(parent: str | os.PathLike, names) -> None:
    """Remove what a killed draftsmith left in `parent` under the temporary names of `names` (glob patterns
    of the files and folders a stage writes there): `.<name>.XXXXXXXX.tmp` (atomic_write_bytes, atomic_folder)
    and `.<name>.XXXXXXXX.old` (atomic_folder). Never a user's file: an earlier output moved aside goes back
    when its place is empty, and a user's file moved into an unfinished new folder goes back where it was.

    Only where no other process writes those names (the stage holds the folder)."""
    parent = Path(parent)
    if not _is_dir(parent):
        return
    found = []
    for entry in os.scandir(parent):
        m = _TEMPORARY.match(entry.name)
        if m and any(fnmatch.fnmatchcase(m["name"], p) for p in names) and not entry.is_symlink():
            found.append((m["kind"] == "tmp", entry.name, m["name"]))
    for _, stale, name in sorted(found):  # the folders moved aside (.old) first, then the new ones (.tmp)
        path, folder = parent / stale, parent / name
        if not _is_dir(path):
            if stale.endswith(".tmp"):
                path.unlink(missing_ok=True)  # an unfinished file (atomic_write_bytes)
        elif stale.endswith(".old"):
            if not {e.name for e in os.scandir(path)} <= {name}:
                continue  # not what atomic_folder leaves (it holds the one folder it moved aside): not ours
            aside = path / name
            if os.path.lexists(aside) and not os.path.lexists(folder):
                os.replace(aside, folder)  # killed mid-swap: the earlier output goes back
            elif _is_dir(aside) and _is_dir(folder):  # killed after the swap: keep anything the new one lacks
                _move(aside, folder, [rel for rel, where in _unwritten(aside, folder) if where == "free"])
            shutil.rmtree(path, ignore_errors=True)
        elif _rescue(path, folder):
            shutil.rmtree(path, ignore_errors=True)


def remove_written(path: str | os.PathLike, patterns=()) -> None:
    """Remove what draftsmith wrote at `path`, never a file it did not write and never anything behind a link.

    A file (or a link) goes. A folder: the entries its record lists; without a record, the top-level entries
    whose names match `patterns` (none by default), each removed as a folder only draftsmith writes into (its
    own record, else all of it). The folder goes too when nothing is left in it."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if not _is_dir(path):
        path.unlink()
        return
    listed = read_record(path)
    if listed is not None:
        for rel, entry in reversed(list(_scan(path))):  # what a folder holds before the folder
            if rel in listed:
                if entry.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        (path / rel).rmdir()  # (only when empty: a user's file in it stays)
                else:
                    (path / rel).unlink(missing_ok=True)
        (path / RECORD).unlink(missing_ok=True)
    else:
        for entry in list(os.scandir(path)):
            if any(fnmatch.fnmatchcase(entry.name, p) for p in patterns):
                remove_written(path / entry.name, ("*",))
    with contextlib.suppress(OSError):
        path.rmdir()


@contextlib.contextmanager
def atomic_folder(folder: str | os.PathLike, owner: str | None = None, overwrite: bool = False) -> Iterator[Path]:
    """Yield a hidden temporary sibling of `folder`; on success it replaces `folder`, on error it goes.

    The new folder is complete before it is swapped in (`replace_folder`): every file of the old one that
    draftsmith did not write is carried over into it, so a user's file survives, and what draftsmith wrote
    there before and not now goes. With `owner` (a stage name) an existing non-empty `folder` that is not that
    stage's own output is refused before anything is written (with `overwrite`, only one another draftsmith
    stage owns). Temporaries a killed run left under `folder`'s name are cleaned first. An OSError (disk
    full, ...) becomes one DraftsmithError naming `folder`.
    """
    folder = Path(folder)
    if owner is not None and _is_dir(folder) and not is_empty(folder) and not owns(folder, owner):
        if not overwrite or owner_of(folder) is not None:
            raise not_owned_error(folder, owner, overwrite)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        clean_temporaries(folder.parent, [glob.escape(folder.name)])
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    except OSError as e:
        raise write_error(folder, e) from e
    try:
        yield tmp
        give_default_modes(tmp)  # mkdtemp makes 0700 (and some writers 0600): nobody else could read it
        replace_folder(tmp, folder)
    except BaseException as e:
        with contextlib.suppress(OSError):
            if _rescue(tmp, folder):  # (a user's file moved in and not back yet goes back first)
                shutil.rmtree(tmp, ignore_errors=True)
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
# Outputs: a stage writes only into a new folder, an empty one, or its own earlier output (with
# overwrite=true also into a user's folder, never another stage's), and never removes a file it did not write.

OWNER = ".draftsmith_owner.json"  # {"stage": ...}: written into an out folder before a stage's first write
STAGE_NAMES = {"data_gen": "data-gen", "train": "train", "eval": "eval", "export": "export", "demo": "demo",
               "publish": "publish"}
OWNER_WORDS = {
    "data_gen": "data-gen's output", "train": "a training run", "eval": "an eval report",
    "export": "an exported head", "demo": "a demo run", "publish": "a publish folder", "train_head": "a trained head (train's final/ folder)",
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
    """The stage whose output `folder` is: its owner file, else a manifest naming the stage; else None.

    Nothing else makes a folder draftsmith's (a folder that merely looks like a stage's output is the user's)."""
    folder = Path(folder)
    owner = _read_json_object(folder / OWNER)
    if owner is not None and isinstance(owner.get("stage"), str):
        return owner["stage"]
    manifest = _read_json_object(folder / MANIFEST)
    if manifest is not None and isinstance(manifest.get("produced_by"), dict):
        stage = manifest["produced_by"].get("stage")
        if isinstance(stage, str):
            return "train_head" if stage == "train" else stage  # train's own manifest lives in final/
    return None


def owns(folder: str | os.PathLike, stage: str) -> bool:
    return owner_of(folder) == stage


def not_owned_error(out: Path, stage: str, overwrite: bool = False) -> DraftsmithError:
    """The refusal of an out folder that is not `stage`'s: overwrite=true may write into a user's folder,
    never over another draftsmith stage's output (its owner file and config would then lie)."""
    owner = owner_of(out)
    name = STAGE_NAMES.get(stage, stage)
    if owner is not None and overwrite:
        what = OWNER_WORDS.get(owner, f"draftsmith {owner}'s output")
        return DraftsmithError(f"out={out} already holds {what}, and overwrite=true never writes over another "
                               f"draftsmith stage's output, so choose another out for {name}.")
    what = OWNER_WORDS.get(owner, f"{owner}'s output") if owner else f"files draftsmith {name} did not write"
    return DraftsmithError(f"out={out} already holds {what}; {name} writes only into a new or empty folder or its "
                           f"own earlier output, so choose another out"
                           + (" (or pass overwrite=true to write there anyway)." if owner is None else "."))


def _inside(path: Path, folder: Path) -> bool:
    return folder in path.parents


# What each stage writes in its out folder (glob patterns relative to it), whatever its options: in a folder that is
# not the stage's own (a user's, reached with overwrite=true) a file under one of these names is the user's, and
# prepare_output refuses it before any work rather than replace it. A stage's own earlier output is rewritten as
# before. What a folder written whole holds beyond these (a format's or a tokenizer's own files) is refused at its
# swap (replace_folder). data-gen's entries spell data_gen/run.py's TEMPORARIES (a test keeps them equal).
HEAD_FILES = ("config.json", "model.safetensors", MANIFEST, "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt")
DATASET_FILES = ("data-*.arrow", "dataset_info.json", "state.json")  # a datasets save_to_disk folder
WRITES = {
    "data_gen": ("config.yaml", MANIFEST, ".data_gen_counts.json", ".data_gen_key", ".data_gen.lock", "parts",
                 *(f"{d}/{f}" for d in ("conversations", "tokenized") for f in DATASET_FILES),
                 "hidden_states/shard_*.safetensors", "hidden_states/index.json", "hidden_states/index.rank*.json",
                 "topk_logits/shard_*.safetensors", "topk_logits/index.json",
                 "regenerated/chunk_*.json", "regenerated/self_prompts.json"),
    "train": ("config.yaml", "metrics.jsonl", "val_metrics.json", "checkpoints/step_*", "checkpoints/.tmp-step_*",
              *(f"{d}/{f}" for d in ("final", "best") for f in HEAD_FILES)),
    "eval": ("config.yaml", "report.json", "report.md", "report.png", MANIFEST),
    "export": (*HEAD_FILES, "*.gguf"),
    "publish": ("README.md", "eval/report.json", "eval/report.md", "eval/report.png", *HEAD_FILES),
}
DEMO_FOLDERS = {"data_gen": "data", "train": "head", "eval": "eval"}  # (commands/demo.py's FOLDERS)
WRITES["demo"] = ("config.yaml", "demo_summary.json", "plan.json", *(f"{s}.done.json" for s in DEMO_FOLDERS),
                  *(f"{name}/{p}" for s, name in DEMO_FOLDERS.items() for p in WRITES[s]))  # its stages' too


def users_files_in_the_way(out: Path, stage: str) -> list[Path]:
    """The entries of `out` (a folder that is not `stage`'s own output) under names `stage` writes (WRITES), sorted;
    an empty folder among them is left out (replacing it loses nothing)."""
    found: set[Path] = set()
    for pattern in WRITES.get(stage, ()):
        for name in glob.glob(glob.escape(str(out)) + "/" + pattern, include_hidden=True):
            path = Path(name)
            if os.path.lexists(path) and not _is_empty_dir(path):
                found.add(path)
    return sorted(found)


def in_the_way_error(out: Path, stage: str, paths: list[Path]) -> DraftsmithError:
    """One sentence naming the user's files a stage would otherwise replace (up to five of them)."""
    name = STAGE_NAMES.get(stage, stage)
    shown = [str(p) for p in paths[:5]] + ([f"{len(paths) - 5} more"] if len(paths) > 5 else [])
    files = shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]
    which = "is a file of yours under a name" if len(paths) == 1 else "are files of yours under names"
    return DraftsmithError(f"{files} {which} draftsmith {name} writes, and overwrite=true writes "
                           f"beside your files but never replaces one, so move or rename {'it' if len(paths) == 1 else 'them'}"
                           f" or choose another out.")


def prepare_output(out, stage: str, inputs=(), overwrite: bool = False) -> Path:
    """Check `out` before a stage does any work; returns it as a Path. Writes nothing.

    Accepted: a folder that does not exist, an empty one, or `stage`'s own earlier output; a user's
    folder (one no draftsmith stage owns) only with `overwrite`, and then the stage keeps the user's
    files (atomic_folder, remove_written) and refuses one under a name it writes (WRITES). Always refused: an existing file, a link (out= pointing at
    another folder), the current folder (or one above it), the home folder, another draftsmith
    stage's output, and a folder that is, contains or lies inside one of `inputs` ((option name,
    path) pairs the stage reads), overwrite or not.
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
    if out.is_symlink():  # writing through it would put the output (and its replacements) into that folder
        raise DraftsmithError(f"out={out} is a link to {real}; draftsmith never writes through a link, so pass "
                              f"that folder itself or choose a new one (overwrite=true does not change this).")
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
    if out.is_dir() and not is_empty(out) and not owns(out, stage) and (not overwrite or owner_of(out) is not None):
        raise not_owned_error(out, stage, overwrite)
    if out.is_dir() and not owns(out, stage):  # a user's folder (overwrite=true): its files under our names stay
        in_the_way = users_files_in_the_way(out, stage)
        if in_the_way:
            raise in_the_way_error(out, stage, in_the_way)
    return out


def refuse_links(out: str | os.PathLike, names) -> None:
    """Refuse an out folder in which one of the names a stage writes (`names`: its subfolders) is a link:
    the stage would write, replace and remove files behind it."""
    out = Path(out)
    for name in names:
        if (out / name).is_symlink():
            raise DraftsmithError(f"{out / name} is a link to {os.path.realpath(out / name)}; draftsmith writes "
                                  f"{name}/ itself and never through a link, so remove the link or choose another out.")


def claim_output(out: str | os.PathLike, stage: str) -> Path:
    """Create `out` (checked by prepare_output) and mark it as `stage`'s output, before the stage's first write."""
    out = Path(out)
    atomic_write_json(out / OWNER, {"stage": stage, "tool": "draftsmith", "version": __version__})
    return out
