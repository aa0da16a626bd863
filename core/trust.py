"""What draftsmith reads from a file a user could have received, and what it refuses: weights only from a
complete safetensors file (never a pickle, never through a symbolic link), and a model folder's own code
(transformers' auto_map) only when the user turns trust_remote_code on. The one place each refusal is said, for
targets, heads, draft models and checkpoints alike."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from . import DraftsmithError

SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors library's own limit on the JSON header
# Weights files draftsmith never loads: unpickling them can run any code
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model-*.bin", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def check_weights_file(path: str | os.PathLike, *, links_ok: bool = False) -> Path:
    """The one check every weights loader makes before a safetensors file is opened: refused in one sentence
    naming the file and what to do when it is missing, a symbolic link (`links_ok` False: a link can point at
    any file on this machine; a Hub cache folder, all links, passes links_ok=True), or not a complete safetensors
    file (truncated, extra bytes, another format). Reads only the 8-byte length and the JSON header."""
    path = Path(path)
    if path.is_symlink() and not links_ok:
        raise DraftsmithError(f"{path} is a symbolic link (to {os.readlink(path)}); draftsmith reads weights only "
                              f"from a plain file in the folder, as a link can point at any file on this machine: "
                              f"put the file itself there (or remove the link).")
    if not path.is_file():
        pickled = next((f for pattern in PICKLED_WEIGHTS for f in sorted(path.parent.glob(pattern))), None)
        if pickled is not None:
            raise DraftsmithError(f"{path.parent} has no {path.name}, only pickled weights ({pickled}), which draftsmith "
                                  f"never loads (unpickling can run any code): convert them to safetensors where you "
                                  f"trust the file (AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, "
                                  f"safe_serialization=True)) and pass the converted folder.")
        raise DraftsmithError(f"{path.parent} has no {path.name}.")
    size = path.stat().st_size
    fix = "copy it again from where it came from, or rerun the stage that wrote it"
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else None
        if length is None or length > min(size - 8, SAFETENSORS_MAX_HEADER):
            raise DraftsmithError(f"{path} is truncated or not a safetensors file ({size} bytes, too short for the "
                                  f"header it starts with); {fix}.")
        try:
            header = json.loads(f.read(length))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise DraftsmithError(f"{path} is not a safetensors file (its header is not a safetensors header); "
                                  f"{fix}.") from None
    need = 8 + length + max(ends, default=0)
    if size != need:
        said = "is truncated" if size < need else f"has {size - need} bytes after its last tensor"
        raise DraftsmithError(f"{path} {said}: its header lists {need} bytes, the file has {size}; {fix}.")
    return path


# Files of a model folder that may name the folder's own code (transformers' auto_map), in the order they are read
CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


def code_file(name: str | os.PathLike) -> Optional[str]:
    """The first file of a local model folder whose JSON has an `auto_map` (code transformers would import), if any."""
    for file in CODE_FILES:
        path = Path(name) / file
        try:
            if "auto_map" in json.loads(path.read_text()):
                return str(path)
        except (OSError, ValueError, TypeError):
            continue
    return None


class remote_code_refused:
    """`with remote_code_refused(name, what, fix):` around a transformers from_pretrained: transformers' refusal
    of a folder or Hub repo that needs its own code (auto_map, and no trust_remote_code) becomes one sentence
    naming the file and `fix`. The one place this is said, for targets and draft models."""

    def __init__(self, name: str | os.PathLike, what: str, fix: str):
        self.name, self.what, self.fix = str(name), what, fix

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if not (isinstance(error, ValueError) and "trust_remote_code" in str(error)):
            return False
        file = code_file(self.name) if Path(self.name).is_dir() else None
        where = f"{file} ({self.what} {self.name!r})" if file else f"{self.what} {self.name!r} (on the Hub)"
        raise DraftsmithError(f"{where} names its own code to run (auto_map); {self.fix}.") from None
