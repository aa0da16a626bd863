"""No local path goes public: what publish's folder says instead of a local path (the head's is replaced by the
repo id, a local target's by base_model, the prompts file's by its name, any other under the home, working or input
folders by its last part)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from draftsmith.core.artifacts import OWNER, atomic_write_bytes
from draftsmith.data_gen.target import PRESETS


PATH_CHARS = r"[^\s\"'`<>|,;()\[\]{}\\]"  # what a path in the folder's text runs on with
BINARY_SUFFIXES = (".safetensors", ".png", ".jpg", ".jpeg", ".gif", ".bin", ".pt", ".gguf")


def _escaped(text: str) -> str:
    return json.dumps(text)[1:-1]  # how the text stands in a JSON file


def _replaced_by(new: str) -> Callable[[re.Match[str]], str]:
    """re.sub's replacement by `new` as it is (a string replacement would read its backslashes as escapes)."""
    return lambda m: new


def _last_part_under(root: str) -> Callable[[re.Match[str]], str]:
    """re.sub's replacement of a path under `root` by its last part, and of `root` itself by <local folder>."""
    def last_part(m: re.Match[str]) -> str:
        path = m.group(0).rstrip("/")
        return path.rsplit("/", 1)[-1] if path != root else "<local folder>"
    return last_part


@dataclass
class PublicPaths:
    """What the Hub copy says instead of a local path: `names` maps a local path (and any path below it) to its
    public name; any other path under one of `roots` (the home and working folders, the folders holding the
    inputs) becomes its last part."""

    names: dict[str, str]
    roots: list[str]

    def text(self, text: str) -> str:
        edge = r"(?<![\w.~/-])"
        for old in sorted(self.names, key=len, reverse=True):
            new = self.names[old]
            for o, n in {(old, new), (_escaped(old), _escaped(new))}:
                text = re.sub(edge + re.escape(o) + r"(?![\w.-])", _replaced_by(n), text)
        for root in sorted(self.roots, key=len, reverse=True):
            for r in {root, _escaped(root)}:
                text = re.sub(edge + re.escape(r) + f"(?:/{PATH_CHARS}*)?" + r"(?![\w.-])", _last_part_under(r),
                              text)
        return text

    def rewrite(self, folder: Path) -> None:
        """Every text file under `folder` (weights and images aside) with its local paths replaced."""
        for path in sorted(folder.rglob("*")):
            if not path.is_file() or path.is_symlink() or path.name == OWNER or path.suffix in BINARY_SUFFIXES:
                continue
            data = path.read_bytes()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            public = self.text(text)
            if public != text:
                atomic_write_bytes(path, public.encode())


def path_forms(path) -> set[str]:
    """The spellings a local path may stand in a file under: as given (when it names a folder in it), absolute,
    resolved."""
    text = str(path).rstrip("/") or str(path)
    forms = {text} if "/" in text or os.sep in text else set()
    local = Path(text).expanduser()
    return forms | {os.path.abspath(local), str(local.resolve())}


def is_local_path(name: str) -> bool:
    return bool(name) and name not in PRESETS and (os.path.isabs(name) or name.startswith((".", "~"))
                                                   or Path(name).expanduser().exists())


def public_paths(cfg, folder: Path, report: Optional[tuple[dict, Path]], target: dict, base_model: str,
                 repo_id: str) -> PublicPaths:
    """The local paths the published folder must not hold and what it says instead: the head (as given, its
    final/, as eval recorded it) -> the repo id, a local target -> base_model, the eval folder -> eval, the
    prompts file -> its name; anything else under the home, working or input folders -> its last part."""
    names: dict[str, str] = {}
    roots = {str(Path.home()), os.getcwd()}

    def add(path, public: str) -> None:
        if not path:
            return
        for form in path_forms(path):
            names.setdefault(form, public)
            roots.add(os.path.dirname(form))

    data = report[0] if report else {}
    for head in (cfg.head, folder, (data.get("drafter") or {}).get("path"), data.get("head")):
        add(head, repo_id)
    for target_id in (target.get("target_id"), (data.get("target") or {}).get("target_id")):
        if isinstance(target_id, str) and is_local_path(target_id):
            add(target_id, base_model)
    if report:
        add(report[1] / "report.json", "eval/report.json")
        add(report[1], "eval")
    prompts = (data.get("prompts") or {}).get("path")
    if isinstance(prompts, str) and prompts:
        add(prompts, Path(prompts).name)
    return PublicPaths(names, sorted(r for r in roots if os.path.isabs(r) and len(r.rstrip("/")) > 1))
