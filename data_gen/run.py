"""The data-gen stage: prompts -> the target's own conversations -> tokenized set (+ hidden states).

    draftsmith data-gen target=smollm2 prompts=self prompts.n=64 out=runs/smol
    torchrun --nproc-per-node 4 -m draftsmith.cli data-gen ... out=runs/big   # ranks split prompts

Output (`out/`; see draftsmith.data_gen.dataset for the reader's contract):
  conversations/, tokenized/   datasets saved to disk, written under a temporary name and renamed
  hidden_states/               offline mode only; resumable shard by shard
  config.yaml                  the resolved config
  manifest.json                written LAST: a folder without it is not complete

Ranks: with RANK / WORLD_SIZE set (torchrun), rank r takes prompts[r::world_size] and writes
`out/parts/rankNNNNN/` (its conversations, tokenized rows and `done.json`). The rank that finds
every part done (and wins `out/parts/.merge.lock`) merges them in prompt order into `out/`,
captures hidden states if asked, and writes the manifest. With `prompts=self` every rank samples
the same seeded prompt set and keeps its slice.

Resume: rerunning with the same config reuses finished `conversations/` and `tokenized/`
(config.yaml equal) and keeps the finished hidden-state shards.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from draftsmith import DraftsmithError
from draftsmith.data_gen import manifest as mf
from draftsmith.data_gen.capture import capture_hidden_states
from draftsmith.data_gen.prompts import load_prompts
from draftsmith.data_gen.regenerate import SamplingParams, make_backend, regenerate
from draftsmith.data_gen.target import load_target
from draftsmith.data_gen.tokenize import tokenize_samples

COUNT_KEYS = ("prompts", "samples", "tokens", "loss_tokens", "truncated", "dropped", "failed")
STATE = ".data_gen_counts.json"  # counts of a finished tokenized set, for resume and merge


def rank_world() -> tuple[int, int]:
    """(rank, world_size) from the torchrun environment; (0, 1) without it."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise DraftsmithError(f"RANK={rank} is outside WORLD_SIZE={world}.")
    return rank, world


def check_out_folder(out: Path, identity: dict) -> None:
    """Refuse an `out` folder that already holds another target's data (before writing anything)."""
    if (out / mf.MANIFEST).is_file():
        old = mf.read_manifest(out)
        mf.check_same_target(old["target"], identity, where=f"the existing data in out={out}")


def _features():
    import datasets

    seq = getattr(datasets, "List", datasets.Sequence)
    return {
        "conversations": datasets.Features({
            "id": datasets.Value("string"), "category": datasets.Value("string"),
            "messages": seq({"role": datasets.Value("string"), "content": datasets.Value("string")})}),
        "tokenized": datasets.Features({
            "id": datasets.Value("string"), "input_ids": seq(datasets.Value("int32")),
            "loss_mask": seq(datasets.Value("int8"))}),
    }


def save_dataset_atomic(rows: list[dict], features, folder: Path) -> None:
    """save_to_disk under a temporary name, then swap it in: a crash never leaves a half folder."""
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        columns = {k: [r[k] for r in rows] for k in features}  # (from_list drops the schema of an empty set)
        with mf.atomic_folder(folder) as tmp:
            datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(tmp))
    finally:
        if bars:
            datasets.enable_progress_bars()


def generate_part(cfg, target, samples: list[dict]) -> tuple[list[dict], list[dict], dict]:
    """Regenerate and tokenize samples; (conversations, tokenized rows, counts)."""
    failed = 0
    if cfg.regenerate:
        params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens)
        samples, failed = regenerate(samples, make_backend(target, cfg.backend, params), cfg.seed)
    rows, counts = tokenize_samples(samples, target.tokenizer, target.eos_token_ids, cfg.max_length,
                                    cfg.on_overflow, cfg.reasoning)
    by_id = {r["order"]: r for r in rows}
    conversations = [{"id": s["id"], "category": s["category"], "messages": s["messages"], "order": s["order"]}
                     for s in samples if s["order"] in by_id]
    counts["failed"] += failed
    return conversations, rows, counts


def _count(rows: list[dict], counts: dict, prompts: int) -> dict:
    return {"prompts": prompts, "samples": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows),
            "loss_tokens": sum(sum(r["loss_mask"]) for r in rows), **counts}


def write_sets(folder: Path, conversations: list[dict], rows: list[dict], counts: dict, keep_order: bool) -> None:
    feats = _features()
    if keep_order:
        import datasets

        for f in feats.values():
            f["order"] = datasets.Value("int64")
    else:
        conversations = [{k: v for k, v in c.items() if k != "order"} for c in conversations]
        rows = [{k: v for k, v in r.items() if k != "order"} for r in rows]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STATE).unlink(missing_ok=True)
    save_dataset_atomic(conversations, feats["conversations"], folder / "conversations")
    save_dataset_atomic(rows, feats["tokenized"], folder / "tokenized")
    mf.atomic_write_json(folder / STATE, counts)


def merge_parts(out: Path, world: int) -> dict:
    """Assemble every rank's part into `out` in the original prompt order; returns the counts."""
    import datasets

    convs, rows, counts = [], [], {k: 0 for k in COUNT_KEYS}
    for r in range(world):
        part = out / "parts" / f"rank{r:05d}"
        part_counts = mf_read_json(part / STATE)
        for k, v in part_counts.items():
            counts[k] += v
        if part_counts["samples"] == 0:  # (datasets cannot load an empty set back)
            continue
        convs += datasets.load_from_disk(str(part / "conversations")).to_list()
        rows += datasets.load_from_disk(str(part / "tokenized")).to_list()
    convs.sort(key=lambda c: c["order"])
    rows.sort(key=lambda c: c["order"])
    write_sets(out, convs, rows, counts, keep_order=False)
    return counts


def mf_read_json(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


def _claim_merge(out: Path, world: int) -> bool:
    """True for the one rank that should merge: every part is done and it created the lock."""
    parts = out / "parts"
    if not all((parts / f"rank{r:05d}" / STATE).is_file() for r in range(world)):
        return False
    try:
        os.mkdir(parts / ".merge.lock")
    except FileExistsError:
        return False
    return True


def run(cfg) -> dict:
    """Run the stage; returns a summary dict (paths, counts, seconds)."""
    t0 = time.perf_counter()
    out = Path(cfg.out)
    rank, world = rank_world()
    target = load_target(cfg.target)
    identity = target.identity()
    check_out_folder(out, identity)
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)

    reuse = (world == 1 and (out / STATE).is_file() and (out / "config.yaml").is_file()
             and (out / "config.yaml").read_text() == config_yaml)
    if not reuse:
        samples = load_prompts(cfg.prompts, target)
        n_prompts = len(samples)
        for i, s in enumerate(samples):
            s["order"] = i
    if world == 1 and not reuse:
        (out / mf.MANIFEST).unlink(missing_ok=True)  # from here on the folder is not complete
        (out / "config.yaml").unlink(missing_ok=True)  # nor reusable by a later run
        conversations, rows, counts = generate_part(cfg, target, samples)
        if not rows:
            raise DraftsmithError(f"no sample survived data-gen ({_count(rows, counts, n_prompts)}); nothing written.")
        write_sets(out, conversations, rows, _count(rows, counts, n_prompts), keep_order=False)
    elif world > 1:
        part = out / "parts" / f"rank{rank:05d}"
        mine = samples[rank::world]
        conversations, rows, counts = generate_part(cfg, target, mine)
        write_sets(part, conversations, rows, _count(rows, counts, len(mine)), keep_order=True)
        if not _claim_merge(out, world):
            summary = {"out": str(out), "rank": rank, "world_size": world, "merged": False,
                       "counts": mf_read_json(part / STATE), "seconds": round(time.perf_counter() - t0, 2)}
            print(f"data-gen rank {rank}/{world}: {summary['counts']['samples']} samples in {part} "
                  f"({summary['seconds']} s); the last rank to finish merges.", file=sys.stderr)
            return summary
        (out / mf.MANIFEST).unlink(missing_ok=True)
        (out / "config.yaml").unlink(missing_ok=True)
        merge_parts(out, world)
        shutil.rmtree(out / "parts", ignore_errors=True)
    mf.atomic_write_bytes(out / "config.yaml", config_yaml.encode())
    counts = mf_read_json(out / STATE)
    if counts["samples"] == 0:
        raise DraftsmithError(f"no sample survived data-gen (counts: {counts}); nothing usable in {out}.")

    hidden = None
    if cfg.hidden_states:
        import datasets

        ids = datasets.load_from_disk(str(out / "tokenized"))["input_ids"]
        index = capture_hidden_states(target, ids, out / "hidden_states", cfg.hidden_states_dtype,
                                      cfg.samples_per_shard, cfg.capture_batch_size)
        hidden = {k: index[k] for k in ("dtype", "aux_layer_ids", "last_hidden_state", "hidden_size")}
        hidden["shards"] = len(index["shards"])
    elif (out / "hidden_states").exists():
        shutil.rmtree(out / "hidden_states")
    mf.write_manifest(out, stage="data_gen", target=identity, counts=counts, hidden_states=hidden)
    summary = {"out": str(out), "rank": rank, "world_size": world, "merged": True, "counts": counts,
               "hidden_states": hidden, "seconds": round(time.perf_counter() - t0, 2)}
    print(f"data-gen: {counts['samples']} samples, {counts['tokens']} tokens ({counts['loss_tokens']} with loss), "
          f"{counts['truncated']} truncated, {counts['dropped']} dropped, {counts['failed']} failed"
          f"{', hidden states stored' if hidden else ''} -> {out} in {summary['seconds']} s")
    return summary
