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
import threading
from pathlib import Path

import datasets
import numpy as np
import torch
from safetensors import safe_open

from ..core import DraftsmithError
from ..core.artifacts import check_same_target, read_manifest


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


class TokenRows:
    """One list column of a tokenized set (input_ids or loss_mask), row i as a read-only numpy view, cut at
    `max_length`: no copy, no Python list. A set saved by `datasets.save_to_disk` is memory-mapped Arrow, so the
    tokens stay in the file's pages (shared by every rank on the node, dropped by the kernel under pressure) and
    each row costs 16 bytes of index here, whatever its length."""

    def __init__(self, ds: datasets.Dataset, column: str, max_length: int):
        if ds._indices is not None:  # a filtered / shuffled view (never what load_from_disk returns): make it plain
            ds = ds.flatten_indices()
        chunks = ds.data.column(column).chunks  # ListArray (or LargeListArray) per record batch
        self._values = [c.values.to_numpy(zero_copy_only=True) for c in chunks]  # flat, the whole chunk's buffer
        offsets = [c.offsets.to_numpy() for c in chunks]  # (rows + 1,) into that buffer (a slice's own)
        self._chunk = np.concatenate([np.full(len(o) - 1, k, dtype=np.int32) for k, o in enumerate(offsets)])
        self._start = np.concatenate([o[:-1] for o in offsets]).astype(np.int64)
        full = np.concatenate([np.diff(o) for o in offsets]).astype(np.int64)
        self._length = np.minimum(full, max_length).astype(np.int32)

    def __len__(self) -> int:
        return len(self._start)

    def __getitem__(self, i: int) -> np.ndarray:
        """Row i, cut at max_length: a read-only view into the Arrow buffer."""
        start = int(self._start[i])
        return self._values[int(self._chunk[i])][start:start + int(self._length[i])]

    def lengths(self) -> np.ndarray:
        """(rows,) int32: every row's length, cut at max_length."""
        return self._length


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
        self._opening = threading.Lock()  # a prefetch thread and the main thread (held-out rows) may both open

    def __len__(self) -> int:
        return self.index["num_samples"]

    def _handle(self, file: str):
        if file not in self._open:
            with self._opening:
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
