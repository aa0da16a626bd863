"""Prompt sources: files, `datasets` datasets, or the target writing its own user turns.

Every source yields samples `{"id": str, "category": str, "messages": [{"role", "content"}]}`;
the messages keep the assistant turns the source has (regeneration replaces them).

Sources (cfg.source):
  sharegpt  JSONL, `conversations: [{from, value}]`, from in human/user/gpt/assistant/system
  openai    JSONL, `messages: [{role, content}]`
  question  Spec-Bench / MT-bench JSONL: `question_id`, `category`, `turns` (user turns)
  hf        a `datasets` dataset saved to disk, or a hub id (columns `messages` or `conversations`)
  self      Magpie-style: the target writes the user prompts itself
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from draftsmith import DraftsmithError
from draftsmith.data_gen.config import PromptsConfig

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
ROLES = ("system", "user", "assistant")


def load_prompts(cfg: PromptsConfig, target=None) -> list[dict]:
    """Read the prompt set named by `cfg` (first `cfg.n` samples); one sentence if it is empty."""
    if cfg.source == "self":
        if target is None:
            raise DraftsmithError("prompts=self needs the target to write the prompts.")
        samples = self_prompts(target, cfg)
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
    """(line number, object) for each non-blank line; a malformed line names file and line."""
    if not path.is_file():
        raise DraftsmithError(f"prompts.path={str(path)!r}: no such file.")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DraftsmithError(f"{path} line {lineno} is not valid JSON ({e.msg}).") from None
            if not isinstance(obj, dict):
                raise DraftsmithError(f"{path} line {lineno} is not a JSON object.")
            yield lineno, obj


def from_sharegpt(obj: dict) -> list[dict]:
    turns = obj["conversations"]
    return [{"role": SHAREGPT_ROLES[t["from"]], "content": str(t["value"])} for t in turns]


def from_openai(obj: dict) -> list[dict]:
    messages = [{"role": m["role"], "content": str(m["content"])} for m in obj["messages"]]
    if any(m["role"] not in ROLES for m in messages):
        raise KeyError("role")
    return messages


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
        sample_id = obj.get("question_id", obj.get("id", f"{path.stem}-{lineno}"))
        yield {"id": str(sample_id), "category": str(obj.get("category") or ""), "messages": messages,
               "line": lineno}


def _read_file(source: str, path: Path) -> Iterator[dict]:
    for record in read_conversations(source, path):
        if any(m["role"] == "user" for m in record["messages"]):
            yield {k: record[k] for k in ("id", "category", "messages")}


def _read_hf(name: str, split: str) -> Iterator[dict]:
    import datasets

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
    for i, row in enumerate(ds):
        messages = convert(row)
        if any(m["role"] == "user" for m in messages):
            yield {"id": str(row.get("id", f"{Path(name).name}-{i}")), "category": str(row.get("category") or ""),
                   "messages": messages}


# --- self: the target writes the prompts (Magpie) ------------------------------------------

def user_header(tokenizer, system: str | None = None) -> str:
    """The chat template rendered up to and including the user-turn header (e.g. `<|im_start|>user\\n`)."""
    marker = "\x00MAGPIE\x00"
    prefix_msgs = [{"role": "system", "content": system}] if system else []
    rendered = tokenizer.apply_chat_template(prefix_msgs + [{"role": "user", "content": marker}], tokenize=False)
    return rendered[: rendered.index(marker)]


@torch.no_grad()
def self_prompts(target, cfg: PromptsConfig) -> list[dict]:
    """Sample user turns from the target after the bare user header; dedupe; stop at n or max_attempts."""
    from draftsmith.data_gen.regenerate import SamplingParams, generate_tokens

    n = cfg.n if cfg.n is not None else 64
    max_attempts = cfg.max_attempts or 8 * n
    tok = target.tokenizer
    header_ids = tok(user_header(tok, cfg.system), add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_prompt_tokens)
    seen, samples, attempt = set(), [], 0
    while len(samples) < n and attempt < max_attempts:
        batch = min(max(n - len(samples), 8), max_attempts - attempt, 64)
        seeds = [hash_seed(cfg.seed, "self", attempt + j) for j in range(batch)]
        outs = generate_tokens(target, [header_ids] * batch, params, seeds, batch_size=batch,
                               desc="self prompts")
        attempt += batch
        for ids, _ in outs:
            text = tok.decode(ids, skip_special_tokens=True).strip()
            if text and text not in seen and len(samples) < n:
                seen.add(text)
                messages = ([{"role": "system", "content": cfg.system}] if cfg.system else [])
                samples.append({"id": f"self-{len(samples):06d}", "category": "self",
                                "messages": messages + [{"role": "user", "content": text}]})
    return samples


def hash_seed(seed: int, *parts) -> int:
    """A stable 63-bit seed from a base seed and any parts (independent of batching and ranks)."""
    import hashlib

    h = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)
