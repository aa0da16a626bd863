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

The stage's own steps (regenerating, tokenizing, writing a set, capturing) are in draftsmith.data_gen.run,
which calls these.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import datasets
import torch

from draftsmith.core import DraftsmithError
from draftsmith.core import artifacts as mf
from draftsmith.core.locks import acquire_lock as claim_run, claim_dir, claim_file, release_lock
from draftsmith.core.locks import wait_while_progressing
from draftsmith.data_gen.capture import finished_shards, num_shards, write_index

# What a finished tokenized set leaves beside it (in out/, and in each rank's part): the ranks read them to tell
# what the others have done, a rerun to tell what it may reuse.
STATE = ".data_gen_counts.json"  # counts of a finished tokenized set, for resume and merge
KEY = ".data_gen_key"  # what the finished tokenized set was made from (prompts + settings), for resume
COUNT_KEYS = ("prompts", "samples", "tokens", "loss_tokens", "truncated", "dropped", "failed")
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


def read_counts(folder: Path) -> dict:
    """The counts of the finished tokenized set in `folder` (out/ or a part)."""
    return json.loads((folder / STATE).read_text())


# --- the tokenized set: parts, the merge, the wait ----------------------------------------------

def rank_chunks(num_chunks: int, rank: int, world: int) -> range:
    """The regeneration chunks rank `rank` takes: rank, rank + world, ..."""
    return range(rank, num_chunks, world)


def part_folder(out: Path, rank: int) -> Path:
    """Where rank `rank` writes its part of the tokenized set."""
    return out / PARTS / f"rank{rank:05d}"


def set_ready(out: Path, key: str) -> bool:
    """The tokenized set in `out` is finished and was made with `key`."""
    try:
        return (out / KEY).read_text() == key and (out / STATE).is_file()
    except OSError:
        return False


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

def finish_capture(folder: Path, index: dict, num_samples: int, samples_per_shard: int, rank: int,
                   world: int) -> Path | None:
    """After this rank's shards: the rank that finds every shard finished and wins the finalize lock writes
    index.json and gets the lock (held until it has written the manifest); None for the others."""
    print(f"capture: rank {rank}/{world} captured shards {index['captured']}, kept {index['kept']}.",
          file=sys.stderr, flush=True)
    header = {k: v for k, v in index.items() if k not in ("shards", "complete", "captured", "kept")}
    total = num_shards(num_samples, samples_per_shard)
    if len(finished_shards(folder, header)) < total:
        return None  # a rank still captures: the last one writes the index
    finalize = claim_file(folder / FINALIZE)
    if finalize is None:
        print(f"capture: rank {rank}/{world}: every shard is finished; the rank holding {folder / FINALIZE} writes "
              f"the index and the manifest (if no data-gen runs, a killed one left it: delete it and rerun).",
              file=sys.stderr, flush=True)
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
