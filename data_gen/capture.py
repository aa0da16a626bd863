"""Offline hidden-state capture: the target's EAGLE-3 features per sample, in safetensors shards.

Layout of `folder` (normally `out/hidden_states/`):
  shard_00000.safetensors ...  tensors `{i}.aux` (T_i, 3H) and `{i}.last` (T_i, H) for sample i
  index.json  {"shards": [{"file", "first", "count", "bytes"}], "dtype", "aux_layer_ids",
               "last_hidden_state": "post_final_norm", "hidden_size", "num_samples",
               "samples_per_shard", "complete"}

Shard s holds samples [s * samples_per_shard, ...). Each shard is written to a temporary name and
renamed, then recorded in index.json (itself written atomically). A killed job resumes: shards
that the index lists with a matching file size and a readable header naming all their samples are
kept; the rest (missing, truncated, corrupted) are recomputed, so every sample is stored exactly once. Padding is on the right with an attention mask; for a causal
model the real positions do not see it, and it is stripped per sample before storing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from draftsmith.data_gen.manifest import atomic_write_bytes, atomic_write_json
from draftsmith.progress import progress
from draftsmith.data_gen.target import torch_dtype

INDEX = "index.json"


def shard_name(s: int) -> str:
    return f"shard_{s:05d}.safetensors"


def tokens_hash(input_ids: list[list[int]]) -> str:
    """Fingerprint of the sequences, so a resume never mixes shards of different data."""
    import hashlib

    h = hashlib.sha256()
    for x in input_ids:
        h.update(len(x).to_bytes(4, "little"))
        h.update(torch.tensor(x, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:16]


def _index_header(target, dtype: str, input_ids: list[list[int]], samples_per_shard: int) -> dict:
    num_samples = len(input_ids)
    return {"tokens_hash": tokens_hash(input_ids), "dtype": dtype, "aux_layer_ids": list(target.aux_layer_ids), "last_hidden_state": "post_final_norm",
            "hidden_size": target.hidden_size, "num_samples": num_samples, "samples_per_shard": samples_per_shard,
            "target_hash": target.target_hash}


def shard_problem(path: Path, entry: dict) -> str | None:
    """Why a shard file cannot be used as its index entry says (missing, truncated, corrupted), or None.

    Checks the size and the safetensors header (which names every `{i}.aux` / `{i}.last` tensor);
    it reads no tensor data.
    """
    from safetensors import safe_open

    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != entry.get("bytes"):
        return f"has {size} bytes, its index says {entry.get('bytes')} (truncated or overwritten)"
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
    except Exception as e:  # safetensors raises its own error kinds for a bad header
        return f"is not a readable safetensors file ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    first, count = entry.get("first"), entry.get("count")
    if not isinstance(first, int) or not isinstance(count, int):
        return "has a malformed entry in index.json"
    missing = [i for i in range(first, first + count) if f"{i}.aux" not in keys or f"{i}.last" not in keys]
    if missing:
        return f"lacks the hidden states of sample {missing[0]}"
    return None


def _finished_shards(folder: Path, header: dict) -> dict[int, dict]:
    """Shards a previous run of the same job finished: listed in its index, file readable and complete.

    Anything else (no index, a corrupt one, a missing, truncated or corrupted shard) is recomputed.
    """
    path = folder / INDEX
    if not path.is_file():
        return {}
    try:
        old = json.loads(path.read_text())
        if any(old.get(k) != v for k, v in header.items()):
            return {}
        done = {}
        for entry in old.get("shards", []):
            s, first, count = entry["first"] // header["samples_per_shard"], entry["first"], entry["count"]
            if entry["file"] != shard_name(s) or first != s * header["samples_per_shard"] or count < 1:
                continue
            if shard_problem(folder / entry["file"], entry) is None:
                done[s] = entry
    except (ValueError, KeyError, TypeError, AttributeError):  # a corrupt index: start over
        return {}
    return done


def features_batch(target, batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(aux (T, 3H), last (T, H)) per sequence, computed right-padded in one forward."""
    T = max(len(x) for x in batch)
    pad = target.tokenizer.pad_token_id
    input_ids = torch.full((len(batch), T), pad, dtype=torch.long)
    attn = torch.zeros((len(batch), T), dtype=torch.long)
    for r, x in enumerate(batch):
        input_ids[r, : len(x)] = torch.tensor(x)
        attn[r, : len(x)] = 1
    aux, last = target.features(input_ids.to(target.device), attn.to(target.device))  # (B, T, 3H), (B, T, H)
    return [(aux[r, : len(x)], last[r, : len(x)]) for r, x in enumerate(batch)]


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    from safetensors.torch import save

    data = save(tensors)
    atomic_write_bytes(path, data)
    return len(data)


def capture_hidden_states(target, input_ids: list[list[int]], folder: str | Path, dtype: str = "bfloat16",
                          samples_per_shard: int = 256, batch_size: int = 8) -> dict:
    """Capture features for every sequence into resumable shards; returns the index."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    store_dtype = torch_dtype(dtype)
    n = len(input_ids)
    header = _index_header(target, dtype, input_ids, samples_per_shard)
    done = _finished_shards(folder, header)
    num_shards = (n + samples_per_shard - 1) // samples_per_shard
    total = sum(len(x) for x in input_ids)
    kept = sum(len(x) for s in done for x in input_ids[s * samples_per_shard:(s + 1) * samples_per_shard])
    with progress(total=total, desc="capture", unit="tok", initial=kept) as bar:
        for s in range(num_shards):
            first, count = s * samples_per_shard, min(samples_per_shard, n - s * samples_per_shard)
            if s in done:
                continue
            order = sorted(range(first, first + count), key=lambda i: -len(input_ids[i]))
            tensors = {}
            for b in range(0, len(order), batch_size):
                idx = order[b:b + batch_size]
                for i, (aux, last) in zip(idx, features_batch(target, [input_ids[i] for i in idx])):
                    tensors[f"{i}.aux"] = aux.to(store_dtype).cpu().contiguous()
                    tensors[f"{i}.last"] = last.to(store_dtype).cpu().contiguous()
                    bar.update(len(input_ids[i]))
            nbytes = _write_shard(folder / shard_name(s), tensors)
            done[s] = {"file": shard_name(s), "first": first, "count": count, "bytes": nbytes}
            atomic_write_json(folder / INDEX, {**header, "shards": [done[k] for k in sorted(done)], "complete": False})
    index = {**header, "shards": [done[k] for k in sorted(done)], "complete": True}
    for stale in folder.glob("shard_*.safetensors"):  # leftovers of a larger earlier job
        if stale.name not in {e["file"] for e in index["shards"]}:
            stale.unlink()
    atomic_write_json(folder / INDEX, index)
    return index
