"""Prompt sources: files, `datasets` datasets, or the target writing its own user turns.

Every source yields samples `{"id": str, "category": str, "messages": [{"role", "content"}]}`;
the messages keep the assistant turns the source has (regeneration replaces them).

Sources (cfg.source):
  sharegpt  JSONL, `conversations: [{from, value}]`, from in human/user/gpt/assistant/system
  openai    JSONL, `messages: [{role, content}]`
  question  Spec-Bench / MT-bench JSONL: `question_id`, `category`, `turns` (user turns)
  hf        a `datasets` dataset saved to disk, or a hub id (columns `messages` or `conversations`)
  self      Magpie-style: the target writes the user prompts itself (prompts.kinds steers them
            across task kinds; filters.prompts drops degenerate ones: data_gen/filters.py)
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Iterable, Iterator, Optional

import datasets
import torch

from ..core import DraftsmithError
from .config import TASK_OPENERS, PromptsConfig
from .filters import PromptFilter
from .regenerate import SamplingParams, generate_tokens
from .tokenize import apply_chat_template
from ..core.progress import progress
from ..core.sampling import hash_seed

log = logging.getLogger(__name__)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
ROLES = ("system", "user", "assistant")


def load_prompts(cfg: PromptsConfig, target=None, filters=None, dropped: Optional[dict] = None) -> list[dict]:
    """Read the prompt set named by `cfg` (first `cfg.n` samples); one sentence if it is empty.

    `filters` / `dropped`: the quality filters of self-written prompts and their counts (self_prompts)."""
    if cfg.source == "self":
        if target is None:
            raise DraftsmithError("prompts=self needs the target to write the prompts.")
        samples = self_prompts(target, cfg, filters, dropped)
    elif cfg.source in FILE_SOURCES:
        if not cfg.path:
            raise DraftsmithError(f"prompts={cfg.source} needs a file: set prompts.path=<file.jsonl>.")
        samples = list(_read_file(cfg.source, Path(cfg.path)))
    elif cfg.source == "hf":
        if not cfg.path:
            raise DraftsmithError("prompts=hf needs a dataset: set prompts.path=<folder or hub id>.")
        samples = list(_read_hf(cfg.path, cfg.split))
    else:
        raise DraftsmithError(f"prompts.source={cfg.source!r} is not one of self, {', '.join(FILE_SOURCES)}, hf.")
    if cfg.n is not None:
        samples = samples[: cfg.n]
    if not samples:
        raise DraftsmithError(f"the prompt set (prompts.source={cfg.source}, path={cfg.path}) is empty.")
    return samples


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a malformed or non-UTF-8 line names file and line."""
    if not path.is_file():
        raise DraftsmithError(f"prompts.path={str(path)!r}: no such file.")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:  # decoded line by line, so that a bad byte is reported at its own line
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DraftsmithError(f"{path} line {lineno} is not UTF-8 text (byte {raw[e.start]:#04x} at "
                                      f"column {e.start + 1}); convert the file to UTF-8.") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DraftsmithError(f"{path} line {lineno} is not valid JSON ({e.msg}).") from None
            if not isinstance(obj, dict):
                raise DraftsmithError(f"{path} line {lineno} is not a JSON object.")
            yield lineno, obj


class RecordError(ValueError):
    """A record of the right shape with a bad value; the message says what (callers add where)."""


def _content(value, role: str, k: int) -> str:
    """A message's text: a string, or OpenAI text parts joined; null only for an assistant turn (regenerated)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    if value is None and role == "assistant":
        return ""
    raise RecordError(f"message {k + 1} ({role}) has content {json.dumps(value)[:40]}, not text")


def from_sharegpt(obj: dict) -> list[dict]:
    turns = obj["conversations"]
    return [{"role": SHAREGPT_ROLES[t["from"]], "content": _content(t["value"], SHAREGPT_ROLES[t["from"]], k)}
            for k, t in enumerate(turns)]


def from_openai(obj: dict) -> list[dict]:
    if any(m["role"] not in ROLES for m in obj["messages"]):
        raise KeyError("role")
    return [{"role": m["role"], "content": _content(m["content"], m["role"], k)} for k, m in enumerate(obj["messages"])]


def from_question(obj: dict) -> list[dict]:
    turns = obj["turns"]
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise TypeError("turns")
    return [{"role": "user", "content": t} for t in turns]


FILE_SOURCES = {"sharegpt": from_sharegpt, "openai": from_openai, "question": from_question}
EXPECTED = {"sharegpt": "`conversations: [{from, value}]`", "openai": "`messages: [{role, content}]`",
            "question": "`turns: [str]`"}


def read_conversations(source: str, path: Path) -> Iterator[dict]:
    """{id, category, messages, line} for each record of a sharegpt / openai / question JSONL file.

    Messages come back as `{role, content}`; a record of the wrong shape names file and line.
    """
    convert = FILE_SOURCES[source]
    for lineno, obj in read_jsonl(path):
        try:
            messages = convert(obj)
        except (KeyError, TypeError, AttributeError):
            raise DraftsmithError(f"{path} line {lineno} does not hold a {source} record "
                                  f"({EXPECTED[source]}).") from None
        except RecordError as e:
            raise DraftsmithError(f"{path} line {lineno}: {e}.") from None
        sample_id = obj.get("question_id", obj.get("id", f"{path.stem}-{lineno}"))
        yield {"id": str(sample_id), "category": str(obj.get("category") or ""), "messages": messages,
               "line": lineno}


def with_user_turn(records: Iterable[dict], where: str, skipped: Optional[list] = None,
                   unit: str = "line") -> Iterator[dict]:
    """The records that have a user turn. The others (nothing to answer) are skipped, never silently:
    one line on stderr says how many and where (`line` of each record), and `skipped` collects them.

    The one rule for a record without a user turn, in data-gen and eval alike.
    """
    skipped = [] if skipped is None else skipped
    for record in records:
        if any(m["role"] == "user" for m in record["messages"]):
            yield record
        else:
            skipped.append(record["line"])
    if skipped:
        log.warning(f"prompts: skipped {skipped_text(skipped, where, unit)}.")


def skipped_text(skipped: list, where: str, unit: str = "line") -> str:
    """`3 record(s) of q.jsonl without a user turn (lines 4, 9, 12)`."""
    shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
    return f"{len(skipped)} record(s) of {where} without a user turn ({unit}{'s' if len(skipped) > 1 else ''} {shown})"


def _read_file(source: str, path: Path) -> Iterator[dict]:
    for record in with_user_turn(read_conversations(source, path), str(path)):
        yield {k: record[k] for k in ("id", "category", "messages")}


def _read_hf(name: str, split: str) -> Iterator[dict]:
    try:
        if Path(name).is_dir():
            ds = datasets.load_from_disk(name)
        else:
            ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many kinds; the user needs one sentence
        raise DraftsmithError(f"prompts.path={name!r} is not a dataset on disk or on the hub "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__}).") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DraftsmithError(f"dataset {name!r} has no split {split!r} (it has {', '.join(ds)}).")
        ds = ds[split]
    if "messages" in ds.column_names:
        convert = from_openai
    elif "conversations" in ds.column_names:
        convert = from_sharegpt
    else:
        raise DraftsmithError(f"dataset {name!r} has neither a `messages` nor a `conversations` column.")

    def records():
        for i, row in enumerate(ds):
            try:
                messages = convert(row)
            except (KeyError, TypeError, AttributeError):
                raise DraftsmithError(f"dataset {name!r} row {i} does not hold a "
                                      f"{'messages' if convert is from_openai else 'conversations'} record.") from None
            except RecordError as e:
                raise DraftsmithError(f"dataset {name!r} row {i}: {e}.") from None
            yield {"id": str(row.get("id", f"{Path(name).name}-{i}")), "category": str(row.get("category") or ""),
                   "messages": messages, "line": i}

    for record in with_user_turn(records(), f"dataset {name!r}", unit="row"):
        yield {k: record[k] for k in ("id", "category", "messages")}


# --- self: the target writes the prompts (Magpie) ------------------------------------------

def user_header(tokenizer, system: str | None = None) -> str:
    """The chat template rendered up to and including the user-turn header (e.g. `<|im_start|>user\\n`)."""
    marker = "\x00MAGPIE\x00"
    prefix_msgs = [{"role": "system", "content": system}] if system else []
    rendered = apply_chat_template(tokenizer, prefix_msgs + [{"role": "user", "content": marker}], tokenize=False)
    return rendered[: rendered.index(marker)]




@torch.no_grad()
def self_prompts(target, cfg: PromptsConfig, filters=None, dropped: Optional[dict] = None) -> list[dict]:
    """Sample user turns from the target after the bare user header (or after an opener of a task kind,
    prompts.kinds); dedupe; stop at n or max_attempts.

    `filters` (a FiltersConfig with filters.prompts on): a prompt that fails a filter of
    data_gen/filters.py is not kept and another is sampled; `dropped` gets each filter's count.
    """
    n = cfg.n if cfg.n is not None else 64
    max_attempts = cfg.max_attempts or 8 * n
    tok = target.tokenizer
    header = user_header(tok, cfg.system)
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_prompt_tokens)
    check = PromptFilter(filters) if filters is not None and filters.prompts else None
    kinds = list(cfg.kinds) if cfg.kinds else None
    seen: set[str] = set()
    samples: list[dict] = []
    attempt = 0
    with progress(total=n, desc="self prompts", unit="prompt") as bar:
        while len(samples) < n and attempt < max_attempts:
            batch = min(max(n - len(samples), 8), max_attempts - attempt, 64)
            seeds = [hash_seed(cfg.seed, "self", attempt + j) for j in range(batch)]
            # the kind goes round robin over the prompts kept so far, so the mix stays even when some are dropped
            kind_of = [kinds[(len(samples) + j) % len(kinds)] if kinds else "self" for j in range(batch)]
            openers = [random.Random(s).choice(TASK_OPENERS[k]) if kinds else "" for s, k in zip(seeds, kind_of)]
            prompts = [tok(header + o, add_special_tokens=False)["input_ids"] for o in openers]
            outs = generate_tokens(target, prompts, params, seeds, batch_size=batch, desc="self prompts")
            attempt += batch
            before = len(samples)
            for (ids, finish), opener, kind in zip(outs, openers, kind_of):
                text = (opener + tok.decode(ids, skip_special_tokens=True)).strip()
                if len(samples) >= n:
                    continue
                if check is not None:  # (it drops empty prompts and exact duplicates too, and counts them)
                    if check.reason(text, finish == "stop") is not None:
                        continue
                elif not text or text in seen:
                    continue
                seen.add(text)
                messages = ([{"role": "system", "content": cfg.system}] if cfg.system else [])
                samples.append({"id": f"self-{len(samples):06d}", "category": kind,
                                "messages": messages + [{"role": "user", "content": text}]})
            bar.update(len(samples) - before)
    if dropped is not None and check is not None:
        dropped.update(check.dropped)
    if check is not None:
        total = sum(check.dropped.values())
        log.info(f"prompts: filters dropped {total} of {total + len(samples)} self-written prompts "
                 f"({filter_counts_text(check.dropped)}).")
    return samples


def filter_counts_text(dropped: dict) -> str:
    """`repetition 3, language 2` from {filtered_prompts_repetition: 3, ...} (zeros left out)."""
    parts = [f"{k.rsplit('_', 1)[1]} {v}" for k, v in dropped.items() if v]
    return ", ".join(parts) or "none"
