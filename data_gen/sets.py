"""data-gen's tokenized set: a prompt list regenerated (data_gen/chunks.py), answer-filtered, tokenized and written
as conversations/ and tokenized/ (datasets saved to disk, each swapped in whole), with its counts and the key of what
it was made from, which a rerun reads to reuse it. One process writes the set into out/; under torchrun each rank
writes its part the same way (draftsmith.data_gen.ranks).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import datasets

from ..core import DraftsmithError
from ..core import artifacts as mf
from .chunks import (REGEN, check_failures, chunk_count, chunks_with_failures, digest,
                                        drop_extra_chunks, prompt_fingerprint, regenerate_chunks)
from .filters import filter_answers
from .tokenize import tokenize_samples

# What a finished tokenized set leaves beside it (in out/, and in each rank's part): the ranks read them to tell
# what the others have done, a rerun to tell what it may reuse.
STATE = ".data_gen_counts.json"  # counts of a finished tokenized set, for resume and merge
KEY = ".data_gen_key"  # what the finished tokenized set was made from (prompts + settings), for resume
COUNT_KEYS = ("prompts", "samples", "tokens", "loss_tokens", "truncated", "dropped", "failed")


def read_counts(folder: Path) -> dict:
    """The counts of the finished tokenized set in `folder` (out/ or a part)."""
    return json.loads((folder / STATE).read_text())


def set_ready(out: Path, key: str) -> bool:
    """The tokenized set in `out` is finished and was made with `key`."""
    try:
        return (out / KEY).read_text() == key and (out / STATE).is_file()
    except OSError:
        return False


def _features():
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
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        columns = {k: [r[k] for r in rows] for k in features}  # (from_list drops the schema of an empty set)
        with mf.atomic_folder(folder) as tmp:
            datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(tmp))
    finally:
        if bars:
            datasets.enable_progress_bars()


def sets_key(cfg, identity: dict, samples: list[dict], settings: dict) -> str:
    """What the tokenized set is made from (prompts + settings): a finished set with this key is reused."""
    return digest({"prompts": prompt_fingerprint(samples), "regenerate": settings if cfg.regenerate else None,
                    "tokenize": [identity["tokenizer_hash"], cfg.max_length, cfg.on_overflow, cfg.reasoning],
                    **({"filters": dataclasses.asdict(cfg.filters)} if cfg.filters.answers else {})})


def generate_part(cfg, target, samples: list[dict], out: Path, settings: dict, chunk_ids=None
                  ) -> tuple[list[dict], list[dict], dict]:
    """Regenerate (resumably) and tokenize the samples of `chunk_ids` (all by default);
    (conversations, tokenized rows, counts)."""
    size = cfg.regenerate_chunk
    if chunk_ids is None:
        chunk_ids = range((len(samples) + size - 1) // size)
    mine = [s for k in chunk_ids for s in samples[k * size:(k + 1) * size]]
    failed = 0
    if cfg.regenerate:
        failures: dict = {}
        messages = regenerate_chunks(cfg, target, samples, out / REGEN, settings, chunk_ids, failures)
        failed = sum(m is None for m in messages)
        check_failures(cfg, samples, failures, len(mine), out / REGEN)
        mine = [{**s, "messages": m} for s, m in zip(mine, messages) if m]
    mine, filtered = filter_answers(mine, cfg.filters) if cfg.filters.answers else (mine, {})  # data_gen/filters.py
    rows, counts = tokenize_samples(mine, target.tokenizer, target.eos_token_ids, cfg.max_length,
                                    cfg.on_overflow, cfg.reasoning)
    by_id = {r["order"]: r for r in rows}
    conversations = [{"id": s["id"], "category": s["category"], "messages": s["messages"], "order": s["order"]}
                     for s in mine if s["order"] in by_id]
    counts["failed"] += failed
    counts.update(filtered)
    return conversations, rows, counts


def count_rows(rows: list[dict], counts: dict, prompts: int) -> dict:
    return {"prompts": prompts, "samples": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows),
            "loss_tokens": sum(sum(r["loss_mask"]) for r in rows), **counts}


def write_sets(folder: Path, conversations: list[dict], rows: list[dict], counts: dict, keep_order: bool) -> None:
    feats = _features()
    if keep_order:
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


def unfinish(out: Path) -> None:
    """From here on the folder is not complete, nor its tokenized set reusable by a later run."""
    for name in (mf.MANIFEST, "config.yaml", KEY):
        (out / name).unlink(missing_ok=True)


def build_whole_sets(cfg, target, samples: list[dict], out: Path, settings: dict, key: str) -> None:
    """One process: regenerate (reusing finished chunks) and tokenize, unless a finished tokenized set
    made with the same key is there already."""
    if (out / STATE).is_file() and (out / KEY).is_file() and (out / KEY).read_text() == key \
            and not (cfg.regenerate and chunks_with_failures(out)):
        return
    unfinish(out)
    conversations, rows, counts = generate_part(cfg, target, samples, out, settings)
    if not rows:
        raise DraftsmithError(f"no sample survived data-gen ({count_rows(rows, counts, len(samples))}); nothing "
                              f"written.")
    write_sets(out, conversations, rows, count_rows(rows, counts, len(samples)), keep_order=False)
    mf.atomic_write_bytes(out / KEY, key.encode())
    drop_extra_chunks(out, chunk_count(cfg, samples))
