"""data-gen's regenerated/ folder: the target's answers, saved chunk by chunk.

Chunk k is the prompts [k * C, (k + 1) * C) (C = regenerate_chunk), written atomically as it finishes to
regenerated/chunk_NNNNN.json with the key of what made it (the prompts and every setting that changes the
answers: `regeneration_settings`); a rerun with the same key reuses it. A prompt whose request still failed after
backend.retries is saved as null, its last error under "failed", and asked again by every rerun; more of them than
backend.max_failed_share end the run with one sentence (`check_failures`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from pathlib import Path

from ..core import DraftsmithError
from ..core import artifacts as mf
from ..core.progress import progress
from .regenerate import SamplingParams, make_backend, regenerate_all, regenerate_in_order

log = logging.getLogger(__name__)

REGEN = "regenerated"  # finished regeneration chunks


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()[:16]


def regeneration_settings(cfg, identity: dict) -> dict:
    """Every setting that changes the regenerated text (draftsmith.data_gen.run's docstring lists them), and nothing
    else."""
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


def prompt_fingerprint(samples: list[dict]) -> list:
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
        key = digest({"settings": settings, "chunk": k, "prompts": prompt_fingerprint(chunk)})
        got = _read_chunk(folder / chunk_name(k), key, len(chunk))
        if got is None:
            todo.append((k, chunk, key, list(range(len(chunk))), None))
        elif any(m is None for m in got):  # failed prompts are never done
            todo.append((k, chunk, key, [i for i, m in enumerate(got) if m is None], got))
        else:
            results[k] = got
    reused = total - sum(len(redo) for *_, redo, _ in todo)
    if reused:
        log.info(f"regenerate: reusing {reused} of {total} prompts already regenerated in {folder}.")
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


def chunk_count(cfg, samples: list) -> int:
    return (len(samples) + cfg.regenerate_chunk - 1) // cfg.regenerate_chunk


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
    log.warning("\n".join([f"regenerate: {n} of {prompts} prompts failed (backend.retries={cfg.backend.retries}):",
                            *lines]))
    if n <= share * prompts and n < prompts:
        log.warning(f"regenerate: {n} failed prompts are within backend.max_failed_share={share:g}: the data is made "
                    f"without them; a rerun asks for them again.")
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


def drop_extra_chunks(out: Path, num_chunks: int) -> None:
    """Remove regeneration chunks beyond this prompt set (left by a larger earlier run)."""
    for f in (out / REGEN).glob("chunk_*.json"):
        k = f.stem.split("_")[1]
        if not k.isdigit() or int(k) >= num_chunks:
            f.unlink(missing_ok=True)


def chunks_with_failures(out: Path) -> bool:
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
