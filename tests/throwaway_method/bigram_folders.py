"""The bigram's folder (the method table's folder hooks)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from safetensors.torch import load_file

from draftsmith.core.method_hooks import FolderHooks
from draftsmith.heads.folders import write_head_folder
from throwaway_method.bigram import ARCH, Bigram


def save_bigram(drafter, folder, identity, stage="train"):
    tensors = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    config = {"architectures": [ARCH], "vocab_size": drafter.config.vocab_size, "hidden": drafter.config.hidden}
    return write_head_folder(Path(folder), tensors, config, drafter.config.vocab_size, identity, stage, "bigram")


def load(folder, target=None):
    config = json.loads((Path(folder) / "config.json").read_text())
    drafter = Bigram(SimpleNamespace(vocab_size=config["vocab_size"], hidden=config["hidden"]))
    drafter.load_state_dict(load_file(str(Path(folder) / "model.safetensors")))
    return drafter.eval()


def save(drafter, folder, identity):
    return save_bigram(drafter, folder, identity)


def export_bigram(drafter, folder, manifest_target, options):
    return save_bigram(drafter, folder, manifest_target, stage="export")


HOOKS = FolderHooks(architectures=(ARCH,), formats={"bigram_bin": export_bigram}, load=load, save=save)
