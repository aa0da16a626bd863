"""Training data: a data-gen folder -> length-bucketed, deterministic, resumable micro-batches.

The order of samples is a pure function of (seed, epoch): shuffle, cut into mega-batches, sort each
mega-batch by length, cut into global batches, shuffle the batches. A global batch of
`micro_batch_size * grad_accum * world_size` samples is cut into micro-batches; micro-batch k
goes to rank k % world_size as accumulation slot k // world_size. So one process with
grad_accum = 2 sees exactly the micro-batches two processes with grad_accum = 1 see, and the
data position is just (epoch, batch index): part of the resumable state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from draftsmith.core import DraftsmithError
from draftsmith.data_gen.capture import shard_problem
from draftsmith.data_gen.dataset import HiddenStates, load_tokenized
from draftsmith.data_gen.topk import TopkLogits


@dataclass
class TrainData:
    """The tokenized rows (lists), optional offline features, and the data folder's manifest."""

    input_ids: list[list[int]]
    loss_mask: list[list[int]]
    hidden: Optional[HiddenStates]
    manifest: dict
    indices: list[int]  # the dataset rows this split uses
    topk: Optional[object] = None  # offline draft distillation: the data's top-k cache (data_gen/topk.py)

    def lengths(self) -> list[int]:
        return [len(self.input_ids[i]) for i in self.indices]


def load_data(data_dir: str, target_identity: dict, mode: str, max_length: int, val_samples: int,
              offline: str = "hidden_states") -> tuple[TrainData, Optional[TrainData], str]:
    """(train split, held-out split or None, resolved mode "online" | "offline").

    `offline` is what the method reads in offline mode (its entry's `offline_data`): hidden_states
    (EAGLE-3 features) or topk_logits (the target's top-k log-probs, data_gen/topk.py)."""
    if offline == "topk_logits":
        return _load_topk_data(data_dir, target_identity, mode, max_length, val_samples)
    if not Path(data_dir).is_dir():
        raise DraftsmithError(f"data={data_dir!r} is not a folder; give a data-gen output folder.")
    ds, manifest = load_tokenized(data_dir, target_identity)
    has_hidden = bool(manifest.get("hidden_states"))
    if mode == "auto":
        mode = "offline" if has_hidden else "online"
    if mode not in ("online", "offline"):
        raise DraftsmithError(f"mode={mode!r} must be auto, online or offline.")
    hidden = None
    if mode == "offline":
        if not has_hidden:
            raise DraftsmithError(f"mode=offline needs hidden states in {data_dir}; rerun data-gen with hidden_states=true.")
        hs_target = {**manifest["target"], "hidden_size": manifest["hidden_states"].get("hidden_size", manifest["target"]["hidden_size"])}
        if hs_target["hidden_size"] != target_identity["hidden_size"]:
            raise DraftsmithError(f"the hidden states in {data_dir} have hidden_size {hs_target['hidden_size']}, "
                                  f"the target has {target_identity['hidden_size']}.")
        if list(manifest["hidden_states"].get("aux_layer_ids", [])) != list(target_identity["aux_layer_ids"]):
            raise DraftsmithError(f"the hidden states in {data_dir} were captured at layers "
                                  f"{manifest['hidden_states'].get('aux_layer_ids')}, the target uses "
                                  f"{target_identity['aux_layer_ids']} (target.aux_layer_ids).")
        hidden = open_hidden_states(data_dir, len(ds))
    ids = [list(x)[:max_length] for x in ds["input_ids"]]
    masks = [list(x)[:max_length] for x in ds["loss_mask"]]
    keep = [i for i in range(len(ids)) if len(ids[i]) >= 2 and sum(masks[i]) > 0]
    if not keep:
        raise DraftsmithError(f"the data in {data_dir} has no sample with a loss-masked token to train on.")
    if val_samples >= len(keep):
        raise DraftsmithError(f"val_samples={val_samples} leaves no training sample out of {len(keep)}.")
    split = len(keep) - val_samples
    train = TrainData(ids, masks, hidden, manifest, keep[:split])
    val = TrainData(ids, masks, hidden, manifest, keep[split:]) if val_samples else None
    return train, val, mode


def _load_topk_data(data_dir: str, target_identity: dict, mode: str, max_length: int, val_samples: int
                    ) -> tuple[TrainData, Optional[TrainData], str]:
    """load_data for a method whose offline signal is data-gen's top-k cache (auto = offline when it is there)."""
    if not Path(data_dir).is_dir():
        raise DraftsmithError(f"data={data_dir!r} is not a folder; give a data-gen output folder.")
    _, manifest = load_tokenized(data_dir, target_identity)
    has_topk = bool(manifest.get("topk_logits"))
    mode = ("offline" if has_topk else "online") if mode == "auto" else mode
    if mode == "offline" and not has_topk:
        raise DraftsmithError(f"mode=offline needs a top-k cache in {data_dir}; rerun data-gen with topk_logits=true.")
    train, val, _ = load_data(data_dir, target_identity, "online", max_length, val_samples)
    if mode == "offline":
        train.topk = TopkLogits(data_dir)
        if len(train.topk) != len(train.input_ids):
            raise DraftsmithError(f"the top-k cache in {data_dir} lists {len(train.topk)} samples but the tokenized "
                                  f"set has {len(train.input_ids)}; rerun data-gen on that folder.")
        if val is not None:
            val.topk = train.topk
    return train, val, mode


def open_hidden_states(data_dir: str, num_rows: int) -> HiddenStates:
    """The data folder's hidden-state shards, checked before training: a missing, empty, truncated or
    corrupted shard (or index) is refused with one sentence naming the file, not met mid-run."""
    redo = "rerun data-gen with the same settings on that folder to recapture it"
    index = Path(data_dir) / "hidden_states" / "index.json"
    try:
        hidden = HiddenStates(data_dir)
        shards, per_shard, num = hidden.shards, int(hidden.per_shard), len(hidden)
        covered = sorted((int(e["first"]), int(e["count"])) for e in shards)
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise DraftsmithError(f"the hidden-state index {index} is corrupted; {redo}.") from None
    if num != num_rows:
        raise DraftsmithError(f"{index} lists {num} samples but the tokenized set in {data_dir} has {num_rows}; {redo}.")
    expected = [(f, min(per_shard, num - f)) for f in range(0, num, per_shard)]
    if covered != expected:
        raise DraftsmithError(f"{index} does not list a shard for every sample (shards of {per_shard} samples "
                              f"for {num}); {redo}.")
    for entry in shards:
        problem = shard_problem(hidden.folder / entry["file"], entry, hidden.stats)
        if problem:
            raise DraftsmithError(f"the hidden-state shard {hidden.folder / entry['file']} {problem}; {redo}.")
    return hidden


def batch_order(lengths: list[int], global_batch: int, mega_batch: int, seed: int, epoch: int) -> list[list[int]]:
    """Positions (into `lengths`) of each global batch of one epoch; the last partial batch is dropped."""
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    mega = global_batch * max(mega_batch, 1)
    batches = []
    for m in range(0, len(order), mega):
        chunk = sorted(order[m:m + mega], key=lambda i: lengths[i])
        batches += [chunk[b:b + global_batch] for b in range(0, len(chunk) - global_batch + 1, global_batch)]
    rng.shuffle(batches)
    return batches


def micro_batches(batch: list[int], micro_batch_size: int, rank: int, world: int) -> list[list[int]]:
    """This rank's micro-batches (its accumulation slots, in order) of one global batch."""
    micro = [batch[k:k + micro_batch_size] for k in range(0, len(batch), micro_batch_size)]
    return micro[rank::world]


def _right_padded(per_row, T: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """(B, T, ...) zeros holding row b's (T_b, ...) tensor at [b, :T_b] (cut at T); dtype: the rows' own."""
    first = per_row[0]
    out = torch.zeros(len(per_row), T, *first.shape[1:], dtype=dtype or first.dtype)
    for b, x in enumerate(per_row):
        n = min(x.shape[0], T)
        out[b, :n] = x[:n]
    return out


def collate(data: TrainData, positions: list[int], device) -> dict:
    """Right-padded tensors of one micro-batch; offline adds aux (B, T, 3H) and last (B, T, H), and
    target_top / target_lse (B, T) when the shards carry them."""
    rows = [data.indices[p] for p in positions]
    T = max(len(data.input_ids[r]) for r in rows)
    B = len(rows)
    input_ids = torch.zeros(B, T, dtype=torch.long)
    attention_mask = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(data.input_ids[r])
        input_ids[b, :n] = torch.tensor(data.input_ids[r], dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(data.loss_mask[r], dtype=torch.long)
    batch = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
             "loss_mask": loss_mask.to(device)}
    if data.hidden is not None:
        batch["aux"], batch["last"] = (_right_padded(x, T).to(device) for x in zip(*(data.hidden[r] for r in rows)))
        if data.hidden.stats:  # the target's argmax and logsumexp per position (padding: never read)
            top, lse = zip(*(data.hidden.target_stats(r) for r in rows))
            batch["target_top"] = _right_padded(top, T, torch.long).to(device)
            batch["target_lse"] = _right_padded(lse, T, torch.float32).to(device)
    if data.topk is not None:  # (B, T, k) ids and log-probs, (B, T) tail; padding positions are never scored
        ids, logp, tail = zip(*(data.topk[r] for r in rows))
        batch["topk_ids"] = _right_padded(ids, T, torch.int32).to(device)
        batch["topk_logp"] = _right_padded(logp, T, torch.float32).to(device)
        batch["topk_tail"] = _right_padded(tail, T, torch.float32).to(device)
    return batch
