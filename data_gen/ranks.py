"""data-gen's ranks: which rank does what, how the ranks wait for each other, and the locks they claim.

Ranks: with RANK / WORLD_SIZE set (torchrun), the prompts are cut into chunks of `regenerate_chunk`;
rank r takes chunks r, r + world_size, ... and writes `out/parts/rankNNNNN/` (its conversations,
tokenized rows, counts and key). The rank that finds every part done (and wins `out/parts/.merge.lock`)
merges them in prompt order into `out/`. Without hidden states it writes the manifest and the other
ranks are done. With `hidden_states=true` the other ranks wait for the merged set (out/.data_gen_key
naming this run's key; DRAFTSMITH_RANK_WAIT_S, default 3600, seconds without any sign of progress
from the other ranks before giving up), then every rank captures the shards s with
s % world_size == r on its own device (target.device=cuda means cuda:LOCAL_RANK); the rank that
finds every shard finished (and wins `out/hidden_states/.finalize.lock`) writes index.json,
config.yaml and the manifest. With `prompts=self` every rank samples the same seeded prompt set and
keeps its chunks. The ranks coordinate through these files only (no torch.distributed), so `out`
must be on a filesystem they all see. If the tokenized set is already finished with this run's key,
no rank regenerates or merges (every rank captures; without hidden states rank 0 writes the manifest).

One process is the plan's simplest case: it builds the whole set and captures every shard. The steps themselves
(regenerating: data_gen/chunks.py; tokenizing and writing a set: data_gen/sets.py; capturing: data_gen/capture.py)
know nothing of ranks; draftsmith.data_gen.run calls the plan in the order of the stage.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import datasets
import torch

from ..core import DraftsmithError
from ..core import artifacts as mf
from ..core.locks import acquire_lock as claim_run, claim_dir, claim_file, release_lock
from ..core.locks import wait_while_progressing
from .capture import WRITTEN as CAPTURE_FILES
from .capture import capture_hidden_states, finished_shards, num_shards, write_index
from .chunks import REGEN, chunk_count, chunks_with_failures, drop_extra_chunks
from .sets import (COUNT_KEYS, KEY, STATE, build_whole_sets, count_rows, generate_part, read_counts,
                                      set_ready, unfinish, write_sets)

log = logging.getLogger(__name__)

LOCK = ".data_gen.lock"  # held while a run writes to `out`
PARTS = "parts"  # in out/: one folder per rank, merged then removed
MERGE_LOCK = ".merge.lock"  # in parts/: created by the rank that merges
FINALIZE = ".finalize.lock"  # in hidden_states/: held by the rank writing the final index and manifest


def rank_device(device: str) -> str:
    """Ranks: target.device=cuda means this rank's GPU, cuda:LOCAL_RANK (modulo the visible GPUs: a
    launcher that gives each rank its own CUDA_VISIBLE_DEVICES leaves LOCAL_RANK unset, hence cuda:0)."""
    if device != "cuda":
        return device
    count = max(torch.cuda.device_count(), 1)
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % count}"


def acquire_lock(out: Path, rank: int = 0) -> Path:
    """Create `out/.data_gen.lock` (pid, host) atomically; refuse while a live run holds it.

    A lock left by a run that died on this host (its pid is gone) is stale and taken over. Under
    torchrun each rank has its own lock file, so ranks of one job do not exclude each other.
    """
    return claim_run(out / (LOCK if rank == 0 else f".data_gen.rank{rank:05d}.lock"), "data-gen")


def release_locks(*locks: Path | None) -> None:
    """Release the locks this rank holds, in the order given (None: not held)."""
    for lock in locks:
        if lock is not None:
            release_lock(lock)


# --- what this process builds: the whole tokenized set, or its part (and perhaps the merge) --------


def build_sets(cfg, target, samples: list[dict], out: Path, settings: dict, key: str, rank: int = 0,
               world: int = 1) -> tuple[str | None, dict | None]:
    """The tokenized set of `samples` in out/, made by this process or (ranks) merged from every rank's part.
    Returns (state, this rank's part counts): (None, None) for one process, else see build_part_or_merge."""
    if world > 1:
        return build_part_or_merge(cfg, target, samples, out, settings, key, rank, world)
    build_whole_sets(cfg, target, samples, out, settings, key)
    return None, None


def build_part_or_merge(cfg, target, samples: list[dict], out: Path, settings: dict, key: str,
                        rank: int, world: int) -> tuple[str, dict | None]:
    """Several ranks: write this rank's chunks as a part; the last rank to finish merges every part
    into out/ (with hidden states the others wait for it: every rank captures from the merged set).
    Returns (state, this rank's part counts): state is "merged" (this rank merged), "part" (another
    rank merges) or "ready" (the tokenized set was already finished with this key: nothing
    regenerated nor merged, by any rank)."""
    if set_ready(out, key):
        if not (cfg.regenerate and chunks_with_failures(out)):
            return "ready", None
        (out / KEY).unlink(missing_ok=True)  # its failed prompts are asked again: no rank may take this set as done
    part_counts = write_part(cfg, target, samples, out, settings, key, rank, world)
    if not claim_merge(out, world, key):
        if cfg.hidden_states:
            wait_for_merged_set(out, key, rank, world, out / REGEN)
        return "part", part_counts
    unfinish(out)
    conversations, rows, counts = read_parts(out, world)
    write_sets(out, conversations, rows, counts, keep_order=False)
    mf.atomic_write_bytes(out / KEY, key.encode())
    drop_extra_chunks(out, chunk_count(cfg, samples))
    remove_parts(out)
    return "merged", part_counts


def write_part(cfg, target, samples: list[dict], out: Path, settings: dict, key: str, rank: int, world: int) -> dict:
    """Regenerate (reusing finished chunks) and tokenize this rank's chunks into its part; returns its counts."""
    part = part_folder(out, rank)
    chunk_ids = rank_chunks(chunk_count(cfg, samples), rank, world)
    n_mine = sum(len(samples[k * cfg.regenerate_chunk:(k + 1) * cfg.regenerate_chunk]) for k in chunk_ids)
    conversations, rows, counts = generate_part(cfg, target, samples, out, settings, chunk_ids)
    (part / KEY).unlink(missing_ok=True)
    part_counts = count_rows(rows, counts, n_mine)
    write_sets(part, conversations, rows, part_counts, keep_order=True)
    mf.atomic_write_bytes(part / KEY, key.encode())
    return part_counts


# --- parts, the merge, the wait ------------------------------------------------------------------


def rank_chunks(num_chunks: int, rank: int, world: int) -> range:
    """The regeneration chunks rank `rank` takes: rank, rank + world, ..."""
    return range(rank, num_chunks, world)


def part_folder(out: Path, rank: int) -> Path:
    """Where rank `rank` writes its part of the tokenized set."""
    return out / PARTS / f"rank{rank:05d}"


def part_done(out: Path, rank: int, key: str) -> bool:
    """Rank `rank`'s part is finished and made with `key` (a part left by an earlier run with other
    settings is not)."""
    part = part_folder(out, rank)
    try:
        return (part / STATE).is_file() and (part / KEY).read_text() == key
    except OSError:
        return False


def claim_merge(out: Path, world: int, key: str) -> bool:
    """True for the one rank that should merge: every part is done and it created the lock."""
    return all(part_done(out, r, key) for r in range(world)) and claim_dir(out / PARTS / MERGE_LOCK)


def read_parts(out: Path, world: int) -> tuple[list[dict], list[dict], dict]:
    """Every rank's part in the original prompt order: (conversations, tokenized rows, summed counts)."""
    convs, rows, counts = [], [], {k: 0 for k in COUNT_KEYS}
    for r in range(world):
        part = part_folder(out, r)
        part_counts = read_counts(part)
        for k, v in part_counts.items():
            counts[k] = counts.get(k, 0) + v  # (filtered_answers_* too)
        if part_counts["samples"] == 0:  # (datasets cannot load an empty set back)
            continue
        convs += datasets.load_from_disk(str(part / "conversations")).to_list()
        rows += datasets.load_from_disk(str(part / "tokenized")).to_list()
    convs.sort(key=lambda c: c["order"])
    rows.sort(key=lambda c: c["order"])
    return convs, rows, counts


def remove_parts(out: Path) -> None:
    """After the merge: the parts and the merge lock go (a user's file in parts/ stays)."""
    try:
        mf.remove_written(out / PARTS, ("rank*", MERGE_LOCK))
    except OSError:
        pass


def progress_signs(out: Path, world: int, regenerated: Path) -> tuple:
    """What changes while some rank works (folder times change as files are renamed into them):
    regeneration chunks written, parts written, the merge's temporary folders in out/."""
    signs: list[int | None] = []
    for folder in (regenerated, out / PARTS, out, *(part_folder(out, r) for r in range(world))):
        try:
            signs.append(folder.stat().st_mtime_ns)
        except OSError:
            signs.append(None)
    return tuple(signs)


def wait_for_merged_set(out: Path, key: str, rank: int, world: int, regenerated: Path, poll_s: float = 1.0) -> None:
    """Wait until the merging rank has written the tokenized set of this run (out/.data_gen_key == key).

    Gives up after DRAFTSMITH_RANK_WAIT_S seconds (default 3600) in which nothing the ranks write
    changed (regeneration chunks in `regenerated`, parts, the merge), naming the ranks whose part is missing.
    """
    limit = float(os.environ.get("DRAFTSMITH_RANK_WAIT_S", 3600))

    def waiting() -> list[int]:
        return [r for r in range(world) if not part_done(out, r, key)]

    def note() -> str:
        late = waiting()
        return (f"data-gen rank {rank}: waiting for the merged tokenized set"
                f"{f' (ranks {late} are still on their parts)' if late else ' (a rank is merging)'}.")

    def give_up(limit_s: float) -> str:
        late = waiting()
        why = (f"ranks {late} never finished their parts in {out / PARTS}: see their logs" if late else
               f"every part is done but no rank merged them; if no data-gen runs there, a killed merge left "
               f"{out / PARTS / MERGE_LOCK}: delete it and rerun")
        return (f"data-gen rank {rank}: no progress from the other ranks for {limit_s:g} s "
                f"(DRAFTSMITH_RANK_WAIT_S) while waiting for the merged tokenized set; {why}.")

    wait_while_progressing(lambda: set_ready(out, key), lambda: progress_signs(out, world, regenerated), limit,
                           poll_s, note, give_up)


def another_rank_writes_the_manifest(hidden_states: bool, state: str | None, rank: int, world: int) -> bool:
    """Ranks without hidden states: the merging rank writes the manifest (rank 0 when the set was already
    finished); the others are done once their part is."""
    return world > 1 and not hidden_states and not (state == "merged" or (state == "ready" and rank == 0))


# --- the hidden states: the rank that finishes writes the index ----------------------------------


def capture(cfg, target, out: Path, rank: int = 0, world: int = 1) -> tuple[dict | None, dict | None, Path | None]:
    """Offline mode: the hidden states of the tokenized set (finished shards kept); (None, None, None) otherwise.

    Returns (what the manifest records of them, this rank's "captured" and "kept" shards, the finalize lock).
    One process: (.., None, None). Ranks: this rank's shards; the rank that then finds every shard finished
    and wins the finalize lock writes index.json and holds the lock (None for the other ranks).
    """
    if not cfg.hidden_states:
        mf.remove_written(out / "hidden_states", (*CAPTURE_FILES, FINALIZE))  # an earlier run's; not a user's file
        return None, None, None
    ids = datasets.load_from_disk(str(out / "tokenized"))["input_ids"]
    folder = out / "hidden_states"
    index = capture_hidden_states(target, ids, folder, cfg.hidden_states_dtype,
                                  cfg.samples_per_shard, cfg.capture_batch_size, rank, world, cfg.hidden_states_source)
    hidden = {k: index[k] for k in ("dtype", "aux_layer_ids", "last_hidden_state", "hidden_size")}
    if world == 1:
        return {**hidden, "shards": len(index["shards"])}, None, None
    captured = {k: index[k] for k in ("captured", "kept")}
    finalize = finish_capture(folder, index, len(ids), cfg.samples_per_shard, rank, world)
    return {**hidden, "shards": num_shards(len(ids), cfg.samples_per_shard)}, captured, finalize


def finish_capture(folder: Path, index: dict, num_samples: int, samples_per_shard: int, rank: int,
                   world: int) -> Path | None:
    """After this rank's shards: the rank that finds every shard finished and wins the finalize lock writes
    index.json and gets the lock (held until it has written the manifest); None for the others."""
    log.info(f"capture: rank {rank}/{world} captured shards {index['captured']}, kept {index['kept']}.")
    header = {k: v for k, v in index.items() if k not in ("shards", "complete", "captured", "kept")}
    total = num_shards(num_samples, samples_per_shard)
    if len(finished_shards(folder, header)) < total:
        return None  # a rank still captures: the last one writes the index
    finalize = claim_file(folder / FINALIZE)
    if finalize is None:
        log.info(f"capture: rank {rank}/{world}: every shard is finished; the rank holding {folder / FINALIZE} writes "
                 f"the index and the manifest (if no data-gen runs, a killed one left it: delete it and rerun).")
        return None
    done = finished_shards(folder, header)  # again, under the lock
    if len(done) < total:  # (a shard went bad meanwhile: a rerun recomputes it)
        release_lock(finalize)
        raise DraftsmithError(f"hidden-state shards of {folder} went missing or bad while the ranks finished; "
                              f"rerun the same command (finished shards are kept).")
    write_index(folder, header, done)
    return finalize


def rank_result(out: Path, rank: int, world: int, state: str | None, t0: float, captured: dict | None = None,
                counts: dict | None = None) -> dict:
    """The summary of a rank that leaves the manifest to another: its state, its captured shards, its part's counts
    (else the set's)."""
    return {"out": str(out), "rank": rank, "world_size": world, "merged": False, "state": state,
            "captured": captured, "counts": counts or read_counts(out),
            "seconds": round(time.perf_counter() - t0, 2)}
