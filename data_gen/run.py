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
and coordinate through files in `out` (its parts/, the merge and finalize locks): see draftsmith.data_gen.ranks.

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
import hashlib
import json
import sys
import time
from collections import Counter
from operator import attrgetter
from pathlib import Path

import datasets
from omegaconf import OmegaConf

from draftsmith.configs import check_config
from draftsmith.core import DraftsmithError
from draftsmith.core import artifacts as mf
from draftsmith.data_gen.capture import WRITTEN as CAPTURE_FILES
from draftsmith.data_gen.capture import FEATURE_SOURCES, capture_hidden_states, num_shards
from draftsmith.data_gen.config import DataGenConfig
from draftsmith.data_gen.filters import filter_answers
from draftsmith.data_gen.prompts import filter_counts_text, load_prompts
from draftsmith.data_gen.ranks import (FINALIZE, KEY, PARTS, STATE, acquire_lock, another_rank_writes_the_manifest,
                                       claim_merge, finish_capture, part_folder, rank_chunks, rank_result,
                                       read_counts, read_parts, release_locks, remove_parts, set_ready,
                                       rank_device, wait_for_merged_set)
from draftsmith.data_gen.regenerate import (BACKENDS, SamplingParams, make_backend, regenerate_all,
                                            regenerate_in_order)
from draftsmith.data_gen.target import Target, load_target, resolved_target, torch_dtype
from draftsmith.data_gen.tokenize import tokenize_samples
from draftsmith.data_gen.topk import WRITTEN as TOPK_FILES
from draftsmith.data_gen.topk import capture_topk
from draftsmith.core.locks import rank_world
from draftsmith.core.methods import methods
from draftsmith.core.progress import progress

REGEN = "regenerated"  # finished regeneration chunks
SUBFOLDERS = ("conversations", "tokenized", "hidden_states", "topk_logits", REGEN, PARTS)  # what data-gen writes in out
# The names data-gen writes in each folder, whose temporaries a killed run may leave (a rerun removes them).
TEMPORARIES = {"": (*SUBFOLDERS, "config.yaml", mf.MANIFEST, mf.OWNER, STATE, KEY),
               REGEN: ("chunk_*.json", "self_prompts.json"), "hidden_states": CAPTURE_FILES, "topk_logits": TOPK_FILES}


def check_out_folder(out: Path, identity: dict) -> None:
    """Refuse an `out` folder that already holds another target's data (before writing anything)."""
    if (out / mf.MANIFEST).is_file():
        old = mf.read_manifest(out)
        mf.check_same_target(old["target"], identity, where=f"the existing data in out={out}")


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


# --- regeneration, saved chunk by chunk -------------------------------------------------------

def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()[:16]


def regeneration_settings(cfg, identity: dict) -> dict:
    """Every setting that changes the regenerated text (see the module docstring), and nothing else."""
    b = cfg.backend
    settings = {"target_hash": identity["target_hash"], "tokenizer_hash": identity["tokenizer_hash"],
                "dtype": cfg.target.dtype, "seed": cfg.seed, "temperature": cfg.temperature, "top_p": cfg.top_p,
                "max_new_tokens": cfg.max_new_tokens, "regenerate_chunk": cfg.regenerate_chunk, "backend": b.kind}
    if b.kind == "hf":  # which prompts share a batched forward changes the floating-point numerics
        # `generation` names the decode loop (data_gen/batching.py: refilled rows); chunks made by
        # an earlier loop may differ by rounding, so they are regenerated rather than reused.
        settings.update(batch_size=b.batch_size, prune_finished=b.prune_finished, generation="refill-1")
    elif b.kind == "vllm":  # max_num_seqs: which prompts share a step, as for hf
        settings.update(batch_size=b.batch_size)
    else:
        settings.update(url=b.url, model=b.model)
    return settings


def _prompt_fingerprint(samples: list[dict]) -> list:
    return [[s["id"], s["category"], s["messages"]] for s in samples]


def chunk_name(k: int) -> str:
    return f"chunk_{k:05d}.json"


def _read_chunk(path: Path, key: str, count: int):
    """The saved messages of a finished chunk, or None when absent, unreadable or made from other input."""
    try:
        obj = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(obj, dict) or obj.get("key") != key:
        return None
    messages = obj.get("messages")
    return messages if isinstance(messages, list) and len(messages) == count else None


def regenerate_chunks(cfg, target, samples: list[dict], folder: Path, settings: dict, chunk_ids,
                      failures: dict | None = None) -> list:
    """Regenerated messages of the samples of `chunk_ids`, in order (None: failed; []: no user turn).

    Chunk k is samples[k * C:(k + 1) * C] (C = regenerate_chunk); a finished chunk is saved to
    `folder/chunk_NNNNN.json` atomically and reused by a later run with the same key, except its
    failed prompts (null, their last error under "failed"): those are asked for again, every run.
    `failures`, when given, gets {prompt index: Failed} for the prompts that failed in this run.
    """
    size = cfg.regenerate_chunk
    chunks = [(k, samples[k * size:(k + 1) * size]) for k in chunk_ids]
    total = sum(len(c) for _, c in chunks)
    results, todo = {}, []  # todo: (k, chunk, key, indices to regenerate, saved messages or None)
    for k, chunk in chunks:
        key = _digest({"settings": settings, "chunk": k, "prompts": _prompt_fingerprint(chunk)})
        got = _read_chunk(folder / chunk_name(k), key, len(chunk))
        if got is None:
            todo.append((k, chunk, key, list(range(len(chunk))), None))
        elif any(m is None for m in got):  # failed prompts are never done
            todo.append((k, chunk, key, [i for i, m in enumerate(got) if m is None], got))
        else:
            results[k] = got
    reused = total - sum(len(redo) for *_, redo, _ in todo)
    if reused:
        print(f"regenerate: reusing {reused} of {total} prompts already regenerated in {folder}.",
              file=sys.stderr, flush=True)
    if todo:
        folder.mkdir(parents=True, exist_ok=True)
        backend = make_backend(target, cfg.backend, SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                                                 max_new_tokens=cfg.max_new_tokens),
                               dtype=cfg.target.dtype)

        def save(t: int, answers: list, errors: dict) -> None:  # todo[t]'s answers, in todo's order
            k, chunk, key, redo, got = todo[t]
            messages = list(got) if got is not None else [None] * len(chunk)
            for i, m in zip(redo, answers):
                messages[i] = m
            mf.atomic_write_bytes(folder / chunk_name(k), json.dumps(
                {"key": key, "first": k * size, "count": len(chunk), "messages": messages,
                 "failed": {str(redo[j]): str(e) for j, e in sorted(errors.items())}},
                ensure_ascii=False).encode())
            results[k] = messages
            if failures is not None:
                failures.update({k * size + redo[j]: e for j, e in errors.items()})

        with progress(total=total, desc="regenerate", unit="prompt", initial=reused) as bar:
            # a server's next chunks are already asked for while a chunk's last answers come back; regenerate_all
            # is this module's name for it (what a test that counts the chunks wraps)
            regenerate_in_order([chunk if got is None else [chunk[i] for i in redo] for _, chunk, _, redo, got in todo],
                                backend, cfg.seed, save, bar, regenerate_all)
    return [m for k, _ in chunks for m in results[k]]


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


def _failure_hint(kind: str) -> str:
    """What else may help against the main failure, besides the rerun."""
    if kind.startswith("timed out"):
        return ", or raise backend.timeout_s"
    if kind in ("HTTP 429", "HTTP 503"):
        return ", or lower backend.concurrency / raise backend.retries"
    if kind.startswith("HTTP 4") and kind != "HTTP 408":
        return " once what the server refuses is fixed (a refused request is not retried: it fails again as it is)"
    if kind.startswith("cannot connect"):
        return " once the server is up"
    if kind.startswith("reply is not"):
        return " once backend.url names an OpenAI-compatible server (its replies are not chat completions)"
    return ""


def check_failures(cfg, samples: list[dict], failures: dict, prompts: int, folder: Path) -> None:
    """Name every prompt whose regeneration still failed, with its last error (stderr), and refuse the run
    (one sentence naming the main reason) when more than backend.max_failed_share of the `prompts` failed,
    or all of them. Failed prompts are never recorded as done: a rerun asks for them again."""
    if not failures:
        return
    n, share = len(failures), cfg.backend.max_failed_share
    lines = [f"  prompt {i} (id {samples[i]['id']}): {e}" for i, e in sorted(failures.items())]
    if n > 20:
        lines = lines[:20] + [f"  ... and {n - 20} more (each with its last error under \"failed\" in "
                              f"{folder}/chunk_*.json)"]
    print(f"regenerate: {n} of {prompts} prompts failed (backend.retries={cfg.backend.retries}):", *lines,
          sep="\n", file=sys.stderr, flush=True)
    if n <= share * prompts and n < prompts:
        print(f"regenerate: {n} failed prompts are within backend.max_failed_share={share:g}: the data is made "
              f"without them; a rerun asks for them again.", file=sys.stderr, flush=True)
        return
    kinds = Counter(getattr(e, "kind", str(e)) for e in failures.values())
    kind, count = kinds.most_common(1)[0]
    i = min(j for j, e in failures.items() if getattr(e, "kind", str(e)) == kind)
    where = f" at {cfg.backend.url}" if cfg.backend.kind == "openai" else ""
    example = f"prompt {i} (id {samples[i]['id']}): {failures[i]}"
    why = example if n == 1 else f"{kind} for {'all' if count == n else count} of them; e.g. {example}"
    limit = ("none came back" if n == prompts else
             f"more than backend.max_failed_share={share:g} allows")
    kept = "" if n == prompts else f" and the answers that came back are saved in {folder}"
    again = "them" if n == prompts else "only the failed prompts"
    raise DraftsmithError(f"{n} of {prompts} prompts failed to regenerate{where} ({why}), {limit}; they are not "
                          f"recorded as done{kept}: rerun the same command to retry {again}{_failure_hint(kind)}.")


def load_prompts_cached(cfg, target, identity: dict, out: Path) -> tuple[list[dict], dict]:
    """The prompt set and what the prompt filters dropped (data_gen/filters.py; {} unless self-written
    and filters.prompts); self-written prompts are saved in regenerated/ and reused by a rerun with the
    same target, prompts and filter settings (file and dataset sources are read again: they may have changed)."""
    if cfg.prompts.source != "self":
        return load_prompts(cfg.prompts, target), {}
    key = _digest({"target": [identity["target_hash"], identity["tokenizer_hash"], cfg.target.dtype],
                   "prompts": dataclasses.asdict(cfg.prompts),
                   **({"filters": dataclasses.asdict(cfg.filters)} if cfg.filters.prompts else {})})
    path = out / REGEN / "self_prompts.json"
    try:
        saved = json.loads(path.read_bytes())
        if saved["key"] == key and isinstance(saved["samples"], list) and saved["samples"]:
            print(f"prompts: reusing {len(saved['samples'])} self-written prompts from {path}.", file=sys.stderr)
            return saved["samples"], dict(saved.get("filtered") or {})
    except (OSError, ValueError, KeyError, TypeError):
        pass
    filtered: dict = {}
    samples = load_prompts(cfg.prompts, target, cfg.filters, filtered)
    mf.atomic_write_bytes(path, json.dumps({"key": key, "samples": samples, "filtered": filtered},
                                           ensure_ascii=False).encode())
    return samples, filtered


def _drop_extra_chunks(out: Path, num_chunks: int) -> None:
    """Remove regeneration chunks beyond this prompt set (left by a larger earlier run)."""
    for f in (out / REGEN).glob("chunk_*.json"):
        k = f.stem.split("_")[1]
        if not k.isdigit() or int(k) >= num_chunks:
            f.unlink(missing_ok=True)


def _count(rows: list[dict], counts: dict, prompts: int) -> dict:
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


# --- the stage: prompts -> sets -> capture -> manifest --------------------------------------------

def run(cfg: DataGenConfig) -> dict:
    """Run the stage; returns a summary dict (paths, counts, seconds).

    Under torchrun a rank whose share is done while another rank finishes returns its own summary
    (draftsmith.data_gen.ranks)."""
    t0 = time.perf_counter()
    cfg = check_config("data_gen", cfg)  # the typed tree, whatever `cfg` was (a composed config or one built in code)
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
        if world == 1 or not cfg.hidden_states:  # (ranks that capture: the rank that finishes it writes it, below)
            write_config(cfg, out)
        counts = set_counts(out, prompts_filtered)
        hidden, captured, finalize = capture(cfg, target, out, rank, world)
        if captured is not None and finalize is None:  # another rank finishes the capture and writes the manifest
            return rank_result(out, rank, world, state, t0, captured, part_counts or counts)
        if finalize is not None:  # this rank finished the capture: it writes config.yaml and the manifest
            write_config(cfg, out)
        topk = capture_topk(cfg, target, out)  # draft distillation's offline signal (data_gen/topk.py)
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


def sets_key(cfg, identity: dict, samples: list[dict], settings: dict) -> str:
    """What the tokenized set is made from (prompts + settings): a finished set with this key is reused."""
    return _digest({"prompts": _prompt_fingerprint(samples), "regenerate": settings if cfg.regenerate else None,
                    "tokenize": [identity["tokenizer_hash"], cfg.max_length, cfg.on_overflow, cfg.reasoning],
                    **({"filters": dataclasses.asdict(cfg.filters)} if cfg.filters.answers else {})})


def build_sets(cfg, target, samples: list[dict], out: Path, settings: dict, key: str, rank: int = 0,
               world: int = 1) -> tuple[str | None, dict | None]:
    """The tokenized set of `samples` in out/, made by this process or (ranks) merged from every rank's part.
    Returns (state, this rank's part counts): (None, None) for one process, else see build_part_or_merge."""
    if world > 1:
        return build_part_or_merge(cfg, target, samples, out, settings, key, rank, world)
    build_whole_sets(cfg, target, samples, out, settings, key)
    return None, None


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


def _unfinish(out: Path) -> None:
    """From here on the folder is not complete, nor its tokenized set reusable by a later run."""
    for name in (mf.MANIFEST, "config.yaml", KEY):
        (out / name).unlink(missing_ok=True)


def _num_chunks(cfg, samples: list) -> int:
    return (len(samples) + cfg.regenerate_chunk - 1) // cfg.regenerate_chunk


def build_whole_sets(cfg, target, samples: list[dict], out: Path, settings: dict, key: str) -> None:
    """One process: regenerate (reusing finished chunks) and tokenize, unless a finished tokenized set
    made with the same key is there already."""
    if (out / STATE).is_file() and (out / KEY).is_file() and (out / KEY).read_text() == key \
            and not (cfg.regenerate and _chunks_with_failures(out)):
        return
    _unfinish(out)
    conversations, rows, counts = generate_part(cfg, target, samples, out, settings)
    if not rows:
        raise DraftsmithError(f"no sample survived data-gen ({_count(rows, counts, len(samples))}); nothing written.")
    write_sets(out, conversations, rows, _count(rows, counts, len(samples)), keep_order=False)
    mf.atomic_write_bytes(out / KEY, key.encode())
    _drop_extra_chunks(out, _num_chunks(cfg, samples))


def _chunks_with_failures(out: Path) -> bool:
    """Some saved regeneration chunk holds a failed prompt (null): a finished set made without it is not
    done, a rerun asks for the prompt again."""
    for f in (out / REGEN).glob("chunk_*.json"):
        try:
            messages = json.loads(f.read_bytes()).get("messages")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(messages, list) and any(m is None for m in messages):
            return True
    return False


def build_part_or_merge(cfg, target, samples: list[dict], out: Path, settings: dict, key: str,
                        rank: int, world: int) -> tuple[str, dict | None]:
    """Several ranks: write this rank's chunks as a part; the last rank to finish merges every part
    into out/ (with hidden states the others wait for it: every rank captures from the merged set).
    Returns (state, this rank's part counts): state is "merged" (this rank merged), "part" (another
    rank merges) or "ready" (the tokenized set was already finished with this key: nothing
    regenerated nor merged, by any rank)."""
    if set_ready(out, key):
        if not (cfg.regenerate and _chunks_with_failures(out)):
            return "ready", None
        (out / KEY).unlink(missing_ok=True)  # its failed prompts are asked again: no rank may take this set as done
    part_counts = write_part(cfg, target, samples, out, settings, key, rank, world)
    if not claim_merge(out, world, key):
        if cfg.hidden_states:
            wait_for_merged_set(out, key, rank, world, out / REGEN)
        return "part", part_counts
    _unfinish(out)
    conversations, rows, counts = read_parts(out, world)
    write_sets(out, conversations, rows, counts, keep_order=False)
    mf.atomic_write_bytes(out / KEY, key.encode())
    _drop_extra_chunks(out, _num_chunks(cfg, samples))
    remove_parts(out)
    return "merged", part_counts


def write_part(cfg, target, samples: list[dict], out: Path, settings: dict, key: str, rank: int, world: int) -> dict:
    """Regenerate (reusing finished chunks) and tokenize this rank's chunks into its part; returns its counts."""
    part = part_folder(out, rank)
    chunk_ids = rank_chunks(_num_chunks(cfg, samples), rank, world)
    n_mine = sum(len(samples[k * cfg.regenerate_chunk:(k + 1) * cfg.regenerate_chunk]) for k in chunk_ids)
    conversations, rows, counts = generate_part(cfg, target, samples, out, settings, chunk_ids)
    (part / KEY).unlink(missing_ok=True)
    part_counts = _count(rows, counts, n_mine)
    write_sets(part, conversations, rows, part_counts, keep_order=True)
    mf.atomic_write_bytes(part / KEY, key.encode())
    return part_counts


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
