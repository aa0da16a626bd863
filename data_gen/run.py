"""The data-gen stage: prompts -> the target's own conversations -> tokenized set (+ hidden states).

    draftsmith data-gen target=smollm2 prompts=self prompts.n=64 out=runs/smol
    torchrun --nproc-per-node 4 -m draftsmith.cli data-gen ... out=runs/big   # ranks split prompts and shards

Output (`out/`; see draftsmith.data_gen.dataset for the reader's contract):
  conversations/, tokenized/   datasets saved to disk, written under a temporary name and renamed
  hidden_states/               offline mode only; resumable shard by shard
  config.yaml                  the resolved config
  manifest.json                written LAST: a folder without it is not complete

  regenerated/                 the target's answers, one file per chunk of `regenerate_chunk` prompts
                               (chunk_NNNNN.json, written atomically as each chunk finishes); kept as
                               a cache, so that other tokenization or capture settings regenerate nothing;
                               a prompt whose request still failed after backend.retries is saved as
                               null, its last error under "failed", and is never done: every rerun asks
                               for it again (more failed prompts than backend.max_failed_share of them
                               end the run with one sentence, exit 2, after each is named on stderr)
  .data_gen.lock               while a run writes to `out`: its pid and host (a second run is refused)

Ranks: under torchrun (RANK / WORLD_SIZE set) the ranks split the prompts, then the hidden-state shards,
and coordinate through files in `out` (its parts/, the merge and finalize locks): draftsmith.data_gen.ranks says
which rank does what. The steps have their own modules: regenerated/ (data_gen/chunks.py), the tokenized set
(data_gen/sets.py), the hidden states (data_gen/capture.py), the top-k logits (data_gen/topk.py).

The target's weights are loaded the first time they are used (load_target(lazy=True)): a run with
`backend=openai` or `backend=vllm` and no hidden states reads only the tokenizer, chat template and config.

Resume: a rerun redoes only what its changed settings affect (a killed run is a rerun with no change):
  regeneration   a chunk in regenerated/ is reused when its prompts and every setting that changes
                 the answers are equal: the target (weights, tokenizer, dtype), seed, temperature,
                 top_p, max_new_tokens, regenerate_chunk (the chunk bounds) and the backend (hf:
                 batch_size and prune_finished, since batch composition changes padding and so the
                 floating-point numerics; vllm: batch_size; openai: url and model, not concurrency, timeout_s or the
                 retry settings); its failed prompts (null) are asked again, the rest reused;
  tokenization   conversations/ and tokenized/ are reused when those and max_length, on_overflow,
                 reasoning and the answer filters (filters.*, when filters.answers) are equal (key in
                 `.data_gen_key`), else redone from regenerated/; self-written prompts are reused from
                 regenerated/self_prompts.json when the prompts and prompt-filter settings are equal;
  hidden states  finished shards are kept unless hidden_states_dtype, samples_per_shard or the
                 tokenized set changed (capture_batch_size does not redo them).
A resumed run writes the same output as an uninterrupted one: chunk bounds and batches are the same.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from operator import attrgetter
from pathlib import Path

from omegaconf import OmegaConf

from ..core import DraftsmithError
from ..core import artifacts as mf
from ..core.locks import rank_world
from ..core.methods import methods
from .capture import WRITTEN as CAPTURE_FILES
from .capture import FEATURE_SOURCES
from .chunks import REGEN, digest, regeneration_settings
from .config import DataGenConfig
from .prompts import filter_counts_text, load_prompts
from .ranks import (PARTS, acquire_lock, another_rank_writes_the_manifest, build_sets, capture,
                                       rank_device, rank_result, release_locks)
from .regenerate import BACKENDS
from .sets import KEY, STATE, read_counts, sets_key
from .target import Target, load_target, resolved_target, torch_dtype
from .topk import WRITTEN as TOPK_FILES
from .topk import capture_topk

log = logging.getLogger(__name__)

SUBFOLDERS = ("conversations", "tokenized", "hidden_states", "topk_logits", REGEN, PARTS)  # what data-gen writes in out
# The names data-gen writes in each folder, whose temporaries a killed run may leave (a rerun removes them).
TEMPORARIES = {"": (*SUBFOLDERS, "config.yaml", mf.MANIFEST, mf.OWNER, STATE, KEY),
               REGEN: ("chunk_*.json", "self_prompts.json"), "hidden_states": CAPTURE_FILES, "topk_logits": TOPK_FILES}


def check_out_folder(out: Path, identity: dict) -> None:
    """Refuse an `out` folder that already holds another target's data (before writing anything)."""
    if (out / mf.MANIFEST).is_file():
        old = mf.read_manifest(out)
        mf.check_same_target(old["target"], identity, where=f"the existing data in out={out}")


# --- checks that must not wait for the end of a long regeneration ------------------------------


def check_settings(cfg) -> None:
    """Refuse settings used only after regeneration (tokenization, capture) before any work is done."""
    choices = {"on_overflow": ("truncate", "drop"), "reasoning": ("keep", "strip"), "backend.kind": tuple(BACKENDS)}
    for key, allowed in choices.items():
        value = attrgetter(key)(cfg)
        if value not in allowed:
            raise DraftsmithError(f"{key}={value!r} is not one of {', '.join(allowed)}.")
    for key in ("regenerate_chunk", "samples_per_shard", "capture_batch_size", "max_length"):
        value = attrgetter(key)(cfg)
        if not isinstance(value, int) or value < 1:
            raise DraftsmithError(f"{key}={value!r} must be a whole number of at least 1.")
    if cfg.hidden_states:
        torch_dtype(cfg.hidden_states_dtype)
        if cfg.hidden_states_source not in FEATURE_SOURCES:
            raise DraftsmithError(f"hidden_states_source={cfg.hidden_states_source!r} is not one of "
                                  f"{', '.join(FEATURE_SOURCES)}.")
        feature_layers(cfg)


def feature_layers(cfg):
    """The layer request of `hidden_states_for` (a method whose drafter reads target features); None (the target's
    default layers) when it names none."""
    if cfg.hidden_states_for is None:
        return None
    fed = [name for name, m in methods().items() if m.aux_layer_ids is not None]
    if cfg.hidden_states_for not in fed:
        raise DraftsmithError(f"hidden_states_for={cfg.hidden_states_for!r}: hidden states are captured for a method "
                              f"that reads them, one of {', '.join(fed)}.")
    return methods()[cfg.hidden_states_for].aux_layer_ids


# --- the stage: prompts -> sets -> capture -> manifest --------------------------------------------


def run(cfg: DataGenConfig) -> dict:
    """Run the stage; returns a summary dict (paths, counts, seconds).

    `cfg` is the checked, typed tree (draftsmith.configs.check_config: the CLI checks it once, a caller in code
    calls it first). Under torchrun a rank whose share is done while another rank finishes returns its own summary
    (draftsmith.data_gen.ranks)."""
    t0 = time.perf_counter()
    cfg, out, target, identity, dtype_why, rank, world = prepare(cfg)
    lock = acquire_lock(out, rank)
    remove_temporaries(out, world)
    finalize = None  # the lock of the rank that writes the final index and manifest (ranks, hidden states)
    try:
        samples, prompts_filtered = read_prompts(cfg, target, identity, out)
        settings = regeneration_settings(cfg, identity)
        key = sets_key(cfg, identity, samples, settings)
        state, part_counts = build_sets(cfg, target, samples, out, settings, key, rank, world)
        if another_rank_writes_the_manifest(cfg.hidden_states, state, rank, world):
            return rank_result(out, rank, world, state, t0, counts=part_counts)
        counts = set_counts(out, prompts_filtered)
        hidden, captured, finalize = capture(cfg, target, out, rank, world)
        if captured is not None and finalize is None:  # another rank finishes the capture and writes the manifest
            return rank_result(out, rank, world, state, t0, captured, part_counts or counts)
        topk = capture_topk(cfg, target, out)  # draft distillation's offline signal (data_gen/topk.py)
        write_config(cfg, out)  # config.yaml and the manifest, last: by the process (or rank) that finishes
        mf.write_manifest(out, stage="data_gen", target=identity, counts=counts, hidden_states=hidden,
                          topk_logits=topk, target_dtype={"dtype": cfg.target.dtype, "why": dtype_why})
    finally:
        release_locks(finalize, lock)
    return {"out": str(out), "rank": rank, "world_size": world, "merged": True, "counts": counts,
            "hidden_states": hidden, "seconds": round(time.perf_counter() - t0, 2)}


def prepare(cfg: DataGenConfig) -> tuple[DataGenConfig, Path, Target, dict, str, int, int]:
    """Check `out` and the settings (before any work), place this rank, load the target (lazily); (the config
    with target.device and target.dtype=auto resolved: a new one, out, target, its identity, why its dtype, rank,
    world size)."""
    out = mf.prepare_output(cfg.out, "data_gen", [("prompts.path", cfg.prompts.path), ("target", cfg.target.name)],
                            overwrite=bool(cfg.overwrite))
    mf.refuse_links(out, SUBFOLDERS)  # never written (nor removed) through
    rank, world = rank_world()
    check_settings(cfg)  # before loading the target: nothing below may fail late on a bad setting
    target_cfg = dataclasses.replace(cfg.target, device=rank_device(cfg.target.device)) if world > 1 else cfg.target
    target_cfg, dtype_why = resolved_target(target_cfg)  # dtype=auto -> this machine's choice, before any key uses it
    cfg = dataclasses.replace(cfg, target=target_cfg)
    # the weights load where first used (generation, capture); features from the layers hidden_states_for asks for
    target = load_target(cfg.target, lazy=True, layers=feature_layers(cfg) if cfg.hidden_states else None)
    identity = target.identity()
    check_out_folder(out, identity)
    mf.claim_output(out, "data_gen")  # before the first write: a rerun then knows the folder as its own
    return cfg, out, target, identity, dtype_why, rank, world


def remove_temporaries(out: Path, world: int) -> None:
    """What a killed run left under draftsmith's temporary names; one process only (ranks write the same
    folders at once: a temporary there may be another rank's, in use)."""
    if world == 1:
        for name, names in TEMPORARIES.items():
            mf.clean_temporaries(out / name, names)


def read_prompts(cfg, target, identity: dict, out: Path) -> tuple[list[dict], dict]:
    """The prompt set, each prompt numbered, and what the prompt filters dropped (see load_prompts_cached)."""
    samples, filtered = load_prompts_cached(cfg, target, identity, out)
    for i, s in enumerate(samples):
        s["order"] = i  # the prompt's index: rank parts are merged back in this order
    return samples, filtered


def load_prompts_cached(cfg, target, identity: dict, out: Path) -> tuple[list[dict], dict]:
    """The prompt set and what the prompt filters dropped (data_gen/filters.py; {} unless self-written
    and filters.prompts); self-written prompts are saved in regenerated/ and reused by a rerun with the
    same target, prompts and filter settings (file and dataset sources are read again: they may have changed)."""
    if cfg.prompts.source != "self":
        return load_prompts(cfg.prompts, target), {}
    key = digest({"target": [identity["target_hash"], identity["tokenizer_hash"], cfg.target.dtype],
                   "prompts": dataclasses.asdict(cfg.prompts),
                   **({"filters": dataclasses.asdict(cfg.filters)} if cfg.filters.prompts else {})})
    path = out / REGEN / "self_prompts.json"
    try:
        saved = json.loads(path.read_bytes())
        if saved["key"] == key and isinstance(saved["samples"], list) and saved["samples"]:
            log.info(f"prompts: reusing {len(saved['samples'])} self-written prompts from {path}.")
            return saved["samples"], dict(saved.get("filtered") or {})
    except (OSError, ValueError, KeyError, TypeError):
        pass
    filtered: dict = {}
    samples = load_prompts(cfg.prompts, target, cfg.filters, filtered)
    mf.atomic_write_bytes(path, json.dumps({"key": key, "samples": samples, "filtered": filtered},
                                           ensure_ascii=False).encode())
    return samples, filtered


def write_config(cfg, out: Path) -> None:
    mf.atomic_write_bytes(out / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True).encode())


def set_counts(out: Path, prompts_filtered: dict) -> dict:
    """The finished set's counts and what the prompt filters dropped; refuses a set without a sample."""
    counts = {**read_counts(out), **prompts_filtered}
    if counts["samples"] == 0:
        raise DraftsmithError(f"no sample survived data-gen (counts: {counts}); nothing usable in {out}.")
    return counts


def summary(result: dict) -> str:
    """The line the CLI prints after a run."""
    c = result["counts"]
    if not result["merged"] and result.get("captured"):
        got = result["captured"]
        return (f"data-gen rank {result['rank']}/{result['world_size']}: captured hidden-state shards "
                f"{got['captured']} (kept {got['kept']}) in {result['out']}/hidden_states ({result['seconds']} s); "
                f"the last rank to finish writes the index and the manifest.")
    if not result["merged"] and result.get("state") == "ready":
        return (f"data-gen rank {result['rank']}/{result['world_size']}: the tokenized set in {result['out']} was "
                f"already finished ({c['samples']} samples); rank 0 writes the manifest.")
    if not result["merged"]:
        return (f"data-gen rank {result['rank']}/{result['world_size']}: {c['samples']} samples in {result['out']}/parts "
                f"({result['seconds']} s); the last rank to finish merges.")
    return (f"data-gen: {c['samples']} samples, {c['tokens']} tokens ({c['loss_tokens']} with loss), "
            f"{c['truncated']} truncated, {c['dropped']} dropped, {c['failed']} failed"
            f"{', hidden states stored' if result['hidden_states'] else ''}{_filtered_text(c)} -> {result['out']} "
            f"in {result['seconds']} s")


def _filtered_text(counts: dict) -> str:
    """`, filters dropped prompts 12 (repetition 5, language 7), answers 1 (length 1)`; '' without filters."""
    parts = []
    for what in ("prompts", "answers"):
        got = {k: v for k, v in counts.items() if k.startswith(f"filtered_{what}_")}
        if got:
            parts.append(f"{what} {sum(got.values())} ({filter_counts_text(got)})")
    return f", filters dropped {', '.join(parts)}" if parts else ""
