"""Offline target signal for draft-model distillation: the target's top-k log-probs per position.

    draftsmith data-gen ... topk_logits=true topk_k=64 [topk_temperature=1.0]

Layout of `out/topk_logits/` (written once, resumable shard by shard like hidden_states/):
  shard_00000.safetensors ...  for sample i: `{i}.ids` (T_i, k) int32, the k most probable tokens at
                               each position, most probable first; `{i}.logp` (T_i, k) float32, their
                               log-probs; `{i}.tail` (T_i,) float32, log of the mass of every other token
                               (-inf when k equals the vocab)
  index.json                   {"shards": [{"file", "first", "count", "bytes"}], "k", "temperature",
                               "bytes_per_token", "num_samples", "samples_per_shard", "tokens_hash",
                               "target_hash", "complete"}

Log-probs are of softmax(logits / temperature); with the tail the k + 1 outcomes sum to 1, so a
divergence over them is exact up to the cut-off (and exact when k equals the vocab). A position
costs 8k + 4 bytes (k = 64: 516 bytes; the data's manifest states it).
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import torch
from safetensors import safe_open
from safetensors.torch import save

from ..core import DraftsmithError
from ..core.artifacts import atomic_write_bytes, atomic_write_json, remove_written
from .capture import shard_name, tokens_hash
from ..core.progress import progress

FOLDER = "topk_logits"
INDEX = "index.json"
WRITTEN = ("shard_*.safetensors", INDEX)  # what the cache writes in its folder (nothing else)


def bytes_per_token(k: int) -> int:
    return 8 * k + 4  # int32 ids + float32 log-probs, k each, + one float32 tail


@torch.no_grad()
def topk_batch(target, batch: list[list[int]], k: int,
               temperature: float) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(ids (T, k) int32, logp (T, k) float32, tail (T,) float32) per sequence, one right-padded forward."""
    T = max(len(x) for x in batch)
    input_ids = torch.full((len(batch), T), target.tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(batch), T), dtype=torch.long)
    for r, x in enumerate(batch):
        input_ids[r, :len(x)] = torch.tensor(x)
        attn[r, :len(x)] = 1
    hidden = target.model.model(input_ids=input_ids.to(target.device), attention_mask=attn.to(target.device),
                                use_cache=False).last_hidden_state  # (B, T, H)
    lm_head = target.model.get_output_embeddings()
    out = []
    for r, x in enumerate(batch):  # one row at a time: (T, V) logits, never (B, T, V)
        logp = torch.log_softmax(lm_head(hidden[r, :len(x)]).float() / temperature, dim=-1)  # (T, V)
        top, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)  # sorted, most probable first
        tail = torch.logsumexp(logp.scatter(-1, ids, float("-inf")), dim=-1)  # (T,)
        out.append((ids.to(torch.int32).cpu().contiguous(), top.cpu().contiguous(), tail.cpu().contiguous()))
    return out


def _finished(folder: Path, header: dict) -> dict[int, dict]:
    """Shards an earlier run with the same header finished (file present with the recorded size)."""
    try:
        old = json.loads((folder / INDEX).read_text())
        if any(old.get(key) != value for key, value in header.items()):
            return {}
        return {e["first"] // header["samples_per_shard"]: e for e in old["shards"]
                if (folder / e["file"]).is_file() and (folder / e["file"]).stat().st_size == e["bytes"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def capture_topk_logits(target, input_ids: list[list[int]], folder: str | Path, k: int = 64,
                        temperature: float = 1.0, samples_per_shard: int = 256, batch_size: int = 8) -> dict:
    """Write the top-k cache of every sequence into resumable shards; returns the index."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    k = min(k, target.vocab_size)
    n = len(input_ids)
    header = {"k": k, "temperature": temperature, "bytes_per_token": bytes_per_token(k), "num_samples": n,
              "samples_per_shard": samples_per_shard, "tokens_hash": tokens_hash(input_ids),
              "target_hash": target.target_hash}
    done = _finished(folder, header)
    kept = sum(len(x) for s in done for x in input_ids[s * samples_per_shard:(s + 1) * samples_per_shard])
    with progress(total=sum(map(len, input_ids)), desc="top-k logits", unit="tok", initial=kept) as bar:
        for s in range((n + samples_per_shard - 1) // samples_per_shard):
            if s in done:
                continue
            first, count = s * samples_per_shard, min(samples_per_shard, n - s * samples_per_shard)
            order = sorted(range(first, first + count), key=lambda i: -len(input_ids[i]))
            tensors = {}
            for b in range(0, len(order), batch_size):
                idx = order[b:b + batch_size]
                for i, (ids, logp, tail) in zip(idx, topk_batch(target, [input_ids[i] for i in idx], k, temperature)):
                    tensors.update({f"{i}.ids": ids, f"{i}.logp": logp, f"{i}.tail": tail})
                    bar.update(len(input_ids[i]))
            data = save(tensors)
            atomic_write_bytes(folder / shard_name(s), data)
            done[s] = {"file": shard_name(s), "first": first, "count": count, "bytes": len(data)}
            atomic_write_json(folder / INDEX, {**header, "shards": [done[j] for j in sorted(done)], "complete": False})
    index = {**header, "shards": [done[j] for j in sorted(done)], "complete": True}
    for stale in folder.glob("shard_*.safetensors"):
        if stale.name not in {e["file"] for e in index["shards"]}:
            stale.unlink()
    atomic_write_json(folder / INDEX, index)
    return index


def capture_topk(cfg, target, out: Path) -> dict | None:
    """data-gen's step: the cache for out/tokenized (topk_logits=true), else None (and no stale cache)."""
    if not cfg.topk_logits:
        remove_written(out / FOLDER, WRITTEN)  # an earlier run's cache; a user's file there stays
        return None
    ids = datasets.load_from_disk(str(out / "tokenized"))["input_ids"]
    index = capture_topk_logits(target, ids, out / FOLDER, cfg.topk_k, cfg.topk_temperature,
                                cfg.samples_per_shard, cfg.capture_batch_size)
    return {key: index[key] for key in ("k", "temperature", "bytes_per_token")} | {
        "dtype": {"ids": "int32", "logp": "float32", "tail": "float32"}, "shards": len(index["shards"])}


class TopkLogits:
    """A data folder's top-k cache: `cache[i] -> (ids (T_i, k) int32, logp (T_i, k), tail (T_i,))`."""

    def __init__(self, data_dir: str | Path):
        self.folder = Path(data_dir) / FOLDER
        try:
            self.index = json.loads((self.folder / INDEX).read_text())
            complete, self.k, self.temperature = self.index["complete"], self.index["k"], self.index["temperature"]
            self.per_shard = self.index["samples_per_shard"]
        except (OSError, ValueError, KeyError, TypeError):
            raise DraftsmithError(f"{data_dir} has no readable top-k cache ({self.folder / INDEX}); rerun data-gen "
                                  f"with topk_logits=true.") from None
        if not complete:
            raise DraftsmithError(f"the top-k cache in {data_dir} is incomplete; rerun data-gen to resume it.")
        self.shards = sorted(self.index["shards"], key=lambda e: e["first"])
        for e in self.shards:
            path = self.folder / e["file"]
            if not path.is_file() or path.stat().st_size != e["bytes"]:
                raise DraftsmithError(f"the top-k shard {path} is missing or truncated; rerun data-gen with the same "
                                      f"settings on that folder to recapture it.")
        self._open: dict[str, safe_open] = {}  # shard file -> its open handle
        self._safe_open = safe_open

    def __len__(self) -> int:
        return self.index["num_samples"]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        file = self.shards[i // self.per_shard]["file"]
        if file not in self._open:
            self._open[file] = self._safe_open(str(self.folder / file), framework="pt")
        f = self._open[file]
        return f.get_tensor(f"{i}.ids"), f.get_tensor(f"{i}.logp"), f.get_tensor(f"{i}.tail")
