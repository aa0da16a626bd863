"""Readers of a data-gen output folder, for the trainer and eval.

Contract of a data-gen folder `data_dir` (complete only when `manifest.json` exists; it is
written last):
  manifest.json    stage "data_gen", target identity, counts {prompts, samples, tokens,
                   loss_tokens, truncated, dropped, failed}, hidden_states {dtype,
                   aux_layer_ids, last_hidden_state: "post_final_norm", hidden_size} or null
  config.yaml      the resolved data-gen config
  conversations/   datasets.save_to_disk: id (str), category (str), messages [{role, content}]
  tokenized/       datasets.save_to_disk: id (str), input_ids (list int32), loss_mask (list int8);
                   row i is sample i; loss_mask is 1 on assistant content and each assistant
                   turn's end-of-turn token
  hidden_states/   only in offline mode: shard_NNNNN.safetensors with `{i}.aux` (T_i, 3H) and
                   `{i}.last` (T_i, H, after the final norm: target logits = target.logits(last)),
                   and index.json {"shards": [{"file", "first", "count", "bytes"}], "dtype", ...}
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import torch
from safetensors import safe_open

from draftsmith.core import DraftsmithError
from draftsmith.core.artifacts import check_same_target, read_manifest


def load_tokenized(data_dir: str | Path, target_identity: dict | None = None):
    """(tokenized datasets.Dataset with columns id, input_ids, loss_mask; the folder's manifest).

    Refuses (DraftsmithError) a folder without a data_gen manifest, one made for another target
    when `target_identity` (Target.identity()) is given, and an empty set.
    """
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    stage = manifest.get("produced_by", {}).get("stage")
    if stage != "data_gen":
        raise DraftsmithError(f"{data_dir} was produced by stage {stage!r}, not by data-gen.")
    if target_identity is not None:
        check_same_target(manifest["target"], target_identity, where=f"the data in {data_dir}")
    if manifest.get("counts", {}).get("samples") == 0:
        raise DraftsmithError(f"the tokenized set in {data_dir} is empty.")
    ds = datasets.load_from_disk(str(data_dir / "tokenized"))
    if len(ds) == 0:
        raise DraftsmithError(f"the tokenized set in {data_dir} is empty.")
    return ds, manifest


def load_conversations(data_dir: str | Path):
    """The regenerated conversations (datasets.Dataset: id, category, messages)."""
    read_manifest(data_dir)
    return datasets.load_from_disk(str(Path(data_dir) / "conversations"))


class HiddenStates:
    """Offline features of a data-gen folder: `hs[i] -> (aux (T_i, 3H), last (T_i, H))` for sample i.

    Tensors come back in the stored dtype (index["dtype"], bf16 by default); `last` is after the
    target's final norm. Shards are opened lazily with safetensors `safe_open` (memory-mapped)
    and kept open; len(hs) equals the tokenized set's length.
    """

    def __init__(self, data_dir: str | Path):
        self.folder = Path(data_dir) / "hidden_states"
        path = self.folder / "index.json"
        if not path.is_file():
            raise DraftsmithError(f"{data_dir} has no hidden states; run data-gen with hidden_states=true.")
        self.index = json.loads(path.read_text())
        if not self.index.get("complete"):
            raise DraftsmithError(f"the hidden states in {data_dir} are incomplete; rerun data-gen to resume them.")
        self.shards = sorted(self.index["shards"], key=lambda e: e["first"])
        self.per_shard = self.index["samples_per_shard"]
        self._open: dict[str, object] = {}

    def __len__(self) -> int:
        return self.index["num_samples"]

    def _handle(self, file: str):
        if file not in self._open:
            self._open[file] = safe_open(str(self.folder / file), framework="pt")
        return self._open[file]

    @property
    def stats(self) -> tuple[str, ...]:
        """The per-position target statistics the shards carry (("top", "lse"); () for older folders)."""
        return tuple(self.index.get("target_stats", ()))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        f = self._handle(self.shards[i // self.per_shard]["file"])
        return f.get_tensor(f"{i}.aux"), f.get_tensor(f"{i}.last")

    def target_stats(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(top (T_i,) int32, lse (T_i,) float32) of sample i: the target's argmax and logsumexp per position."""
        f = self._handle(self.shards[i // self.per_shard]["file"])
        return f.get_tensor(f"{i}.top"), f.get_tensor(f"{i}.lse")
