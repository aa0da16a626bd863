"""Offline hidden-state capture: the target's EAGLE-3 features per sample, in safetensors shards.

Layout of `folder` (normally `out/hidden_states/`):
  shard_00000.safetensors ...  tensors `{i}.aux` (T_i, 3H) and `{i}.last` (T_i, H) for sample i, and
                               the target's own next-token statistics `{i}.top` (T_i,) int32, the argmax of
                               its full-vocab logits, and `{i}.lse` (T_i,) float32, their logsumexp
  index.json  {"shards": [{"file", "first", "count", "bytes"}], "dtype", "aux_layer_ids",
               "last_hidden_state": "post_final_norm", "target_stats": ["top", "lse"], "hidden_size",
               "num_samples", "samples_per_shard", "complete"}

`top` and `lse` are what training needs of the full vocabulary (is the target's argmax in the draft
vocab; how much of its mass the draft vocab holds), computed here from the unrounded hidden state, so
that a training step multiplies the stored hidden state by the draft-vocab rows of the lm_head only.
Folders written before they existed (no "target_stats" in the index) still train: the step then
recomputes them from the stored `last` through the whole lm_head.

Shard s holds samples [s * samples_per_shard, ...). Each shard is written to a temporary name and
renamed, then recorded in index.json (itself written atomically). A killed job resumes: shards
that the index lists with a matching file size and a readable header naming all their samples are
kept; the rest (missing, truncated, corrupted) are recomputed, so every sample is stored exactly once. Padding is on the right with an attention mask; for a causal
model the real positions do not see it, and it is stripped per sample before storing.

Ranks (world > 1, every rank on its own device, all sharing `folder`): rank r captures the shards
s with s % world == r and records them in its own `index.rankNNNNN.json` (the same entries, written
atomically after each shard); `finished_shards` then reads index.json and every rank's index, so a
resume keeps finished shards whatever the number of ranks was. Once every shard is finished, one
rank writes index.json (`write_index`), which drops the per-rank indexes. Shard s holds the same
samples, computed in the same batches, whatever rank computes it: the output does not depend on
the number of ranks.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save

from ..core import DraftsmithError
from ..core.artifacts import atomic_write_bytes, atomic_write_json
from .target import torch_dtype
from ..core.progress import progress

INDEX = "index.json"
RANK_INDEX = "index.rank{:05d}.json"  # a rank's finished shards, while ranks capture together
WRITTEN = ("shard_*.safetensors", INDEX, "index.rank*.json")  # what capture writes in its folder (nothing else)
TARGET_STATS = ("top", "lse")  # per position: the target's argmax token and the logsumexp of its logits


def shard_name(s: int) -> str:
    return f"shard_{s:05d}.safetensors"


def tokens_hash(input_ids: list[list[int]]) -> str:
    """Fingerprint of the sequences, so a resume never mixes shards of different data."""
    h = hashlib.sha256()
    for x in input_ids:
        h.update(len(x).to_bytes(4, "little"))
        h.update(torch.tensor(x, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()[:16]


def index_header(target, dtype: str, input_ids: list[list[int]], samples_per_shard: int) -> dict:
    num_samples = len(input_ids)
    return {"tokens_hash": tokens_hash(input_ids), "dtype": dtype, "aux_layer_ids": list(target.aux_layer_ids),
            "last_hidden_state": "post_final_norm", "target_stats": list(TARGET_STATS),
            "hidden_size": target.hidden_size, "num_samples": num_samples, "samples_per_shard": samples_per_shard,
            "target_hash": target.target_hash}


def shard_problem(path: Path, entry: dict, stats: tuple[str, ...] = ()) -> str | None:
    """Why a shard file cannot be used as its index entry says (missing, truncated, corrupted), or None.

    Checks the size and the safetensors header (which names every `{i}.aux` / `{i}.last` tensor, and
    `{i}.top` / `{i}.lse` when the entry's index lists target_stats); it reads no tensor data.
    """
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
    names = ("aux", "last", *stats)
    missing = [i for i in range(first, first + count) if any(f"{i}.{n}" not in keys for n in names)]
    if missing:
        return f"lacks the hidden states of sample {missing[0]}"
    return None


def _entries(path: Path, folder: Path, header: dict) -> dict[int, dict]:
    """The usable shards an index file lists (empty for a missing or corrupt index, or another job's)."""
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
            if shard_problem(folder / entry["file"], entry, tuple(header["target_stats"])) is None:
                done[s] = entry
    except (ValueError, KeyError, TypeError, AttributeError):  # a corrupt index: start over
        return {}
    return done


def finished_shards(folder: Path, header: dict) -> dict[int, dict]:
    """Shards a previous run (or another rank) of the same job finished: listed in index.json or a rank's
    index, file readable and complete.

    Anything else (no index, a corrupt one, a missing, truncated or corrupted shard) is recomputed.
    """
    done: dict[int, dict] = {}
    for path in [folder / INDEX, *sorted(folder.glob(RANK_INDEX.replace("{:05d}", "*")))]:
        for s, entry in _entries(path, folder, header).items():
            done.setdefault(s, entry)
    return done


def num_shards(num_samples: int, samples_per_shard: int) -> int:
    return (num_samples + samples_per_shard - 1) // samples_per_shard


def write_index(folder: Path, header: dict, done: dict[int, dict]) -> dict:
    """The complete index.json (every shard in `done`); shard files and rank indexes it does not need go."""
    index = {**header, "shards": [done[k] for k in sorted(done)], "complete": True}
    for stale in folder.glob("shard_*.safetensors"):  # leftovers of a larger earlier job
        if stale.name not in {e["file"] for e in index["shards"]}:
            stale.unlink(missing_ok=True)
    atomic_write_json(folder / INDEX, index)
    for path in folder.glob(RANK_INDEX.replace("{:05d}", "*")):
        path.unlink(missing_ok=True)
    return index


def hf_features(target) -> Callable:
    """The target loaded in this process: its `features(input_ids, attention_mask) -> (aux, last)`."""
    return target.features


# hidden_states_source -> (target -> features(input_ids (B, T), attention_mask (B, T)) -> (aux (B, T, nH), last
# (B, T, H))). vLLM's hidden-state extraction would be a second source; vLLM 0.32.0 for CPU cannot run it
# (its extract_hidden_states pins memory, which needs CUDA), so it is not offered.
FEATURE_SOURCES = {"hf": hf_features}


def features_batch(target, batch: list[list[int]], features: Optional[Callable] = None
                   ) -> list[dict[str, torch.Tensor]]:
    """{"aux" (T, 3H), "last" (T, H), "top" (T,) int32, "lse" (T,) float32} per sequence, computed
    right-padded in one forward of `features` (default: the target's own); the lm_head runs over one sequence's
    positions at a time (a full-vocab (B, T, V) tensor of a large target would not fit)."""
    T = max(len(x) for x in batch)
    pad = target.tokenizer.pad_token_id
    input_ids = torch.full((len(batch), T), pad, dtype=torch.long)
    attn = torch.zeros((len(batch), T), dtype=torch.long)
    for r, x in enumerate(batch):
        input_ids[r, : len(x)] = torch.tensor(x)
        attn[r, : len(x)] = 1
    features = features or target.features
    aux, last = features(input_ids.to(target.device), attn.to(target.device))  # (B, T, 3H), (B, T, H)
    out = []
    for r, x in enumerate(batch):
        logits = target.logits(last[r, : len(x)]).float()  # (T_r, V)
        out.append({"aux": aux[r, : len(x)], "last": last[r, : len(x)], "top": logits.argmax(-1).to(torch.int32),
                    "lse": torch.logsumexp(logits, dim=-1)})
    return out


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    data = save(tensors)
    atomic_write_bytes(path, data)
    return len(data)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` in host memory. From a CUDA device the copy is only queued, into pinned memory, so the GPU goes on
    with the next batch: it holds the values once the stream's work queued so far is done (see `host_ready`)."""
    if t.device.type != "cuda":
        return t.cpu().contiguous()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def host_ready(device: torch.device) -> Optional[torch.cuda.Event]:
    """An event recorded after the copies `to_host` queued on `device` so far (None on a CPU: they are done)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@contextmanager
def in_background(depth: int = 1) -> Iterator[Callable]:
    """Run the calls given to the yielded `submit(fn, *args)` in order, on one writer thread.

    At most `depth` calls wait (each holds a shard in host memory), so the shard being filled, one waiting and
    one being written are all that is held. The first error of a call is raised here in the caller, once: at
    the next submit or at the end of the block; the calls after it are dropped. Leaving the block, even by an
    error, waits for the calls submitted before it, so what they recorded is on disk.
    """
    calls: queue.Queue = queue.Queue(maxsize=depth)
    failed: list[BaseException] = []

    def work() -> None:
        while (call := calls.get()) is not None:
            if not failed:  # after an error, drain: the caller must never block on a full queue
                try:
                    call[0](*call[1:])
                except BaseException as e:  # noqa: BLE001 (re-raised in the caller, a KeyboardInterrupt too)
                    failed.append(e)

    def submit(fn: Callable, *args) -> None:
        if failed:
            raise failed[0]
        calls.put((fn, *args))

    thread = threading.Thread(target=work, name="capture-writer", daemon=True)
    thread.start()
    try:
        yield submit
    finally:
        calls.put(None)
        thread.join()
    if failed:
        raise failed[0]


def capture_hidden_states(target, input_ids: list[list[int]], folder: str | Path, dtype: str = "bfloat16",
                          samples_per_shard: int = 256, batch_size: int = 8, rank: int = 0, world: int = 1,
                          source: str = "hf") -> dict:
    """Capture features for every sequence into resumable shards (from FEATURE_SOURCES[source]); returns the index.

    The target computes shard s + 1 while a writer thread writes shard s (`in_background`); a shard is recorded
    in the index only once its file is written, and the writer has finished every shard before this returns.
    From a CUDA device the features are copied to pinned host memory without waiting (`to_host`); the writer
    waits for those copies (`host_ready`) before it serialises them. The bytes are those of a synchronous write.

    world > 1: capture only this rank's shards (s % world == rank) and record them in its rank index;
    returns a partial index (`complete` False; `captured` / `kept`: this rank's shards written / kept). Whoever
    sees every shard finished (`finished_shards`) then writes index.json with `write_index`.
    """
    folder = Path(folder)
    features = FEATURE_SOURCES[source](target)
    folder.mkdir(parents=True, exist_ok=True)
    store_dtype = torch_dtype(dtype)
    n = len(input_ids)
    header = index_header(target, dtype, input_ids, samples_per_shard)
    done = finished_shards(folder, header)
    mine = [s for s in range(num_shards(n, samples_per_shard)) if s % world == rank]
    total = sum(len(x) for s in mine for x in input_ids[s * samples_per_shard:(s + 1) * samples_per_shard])
    kept = sum(len(x) for s in mine if s in done
               for x in input_ids[s * samples_per_shard:(s + 1) * samples_per_shard])
    captured = {}

    def store(s: int, first: int, count: int, tensors: dict, ready: Optional[torch.cuda.Event]) -> None:
        """On the writer thread: write shard s, then record it (only this thread touches `done` meanwhile)."""
        if ready is not None:
            ready.synchronize()  # the pinned copies of this shard have landed
        try:
            nbytes = _write_shard(folder / shard_name(s), tensors)
        except DraftsmithError:  # (atomic_write_bytes names the file already: a full disk, ...)
            raise
        except Exception as e:  # raised in the caller: one sentence, not the writer thread's traceback
            raise DraftsmithError(f"capture could not write {folder / shard_name(s)} ({type(e).__name__}: {e}).") from e
        done[s] = captured[s] = {"file": shard_name(s), "first": first, "count": count, "bytes": nbytes}
        if world == 1:
            atomic_write_json(folder / INDEX, {**header, "shards": [done[k] for k in sorted(done)], "complete": False})
        else:  # only this rank writes this file (ranks never overwrite each other's records); it also
            # lists what was finished before, so a second kill loses no earlier shard
            atomic_write_json(folder / RANK_INDEX.format(rank), {
                **header, "shards": [done[k] for k in sorted(done)], "complete": False})

    todo = [s for s in mine if s not in done]
    with progress(total=total, desc="capture", unit="tok", initial=kept) as bar, in_background() as submit:
        for s in todo:
            first, count = s * samples_per_shard, min(samples_per_shard, n - s * samples_per_shard)
            order = sorted(range(first, first + count), key=lambda i: -len(input_ids[i]))
            tensors = {}
            for b in range(0, len(order), batch_size):
                idx = order[b:b + batch_size]
                for i, feats in zip(idx, features_batch(target, [input_ids[i] for i in idx], features)):
                    tensors[f"{i}.aux"] = to_host(feats["aux"].to(store_dtype))
                    tensors[f"{i}.last"] = to_host(feats["last"].to(store_dtype))
                    tensors[f"{i}.top"] = to_host(feats["top"])
                    tensors[f"{i}.lse"] = to_host(feats["lse"])
                    bar.update(len(input_ids[i]))
            submit(store, s, first, count, tensors, host_ready(target.device))
    if world == 1:
        return write_index(folder, header, done)
    return {**header, "shards": [captured[k] for k in sorted(captured)], "complete": False,
            "captured": sorted(captured), "kept": sorted(s for s in mine if s not in captured)}
