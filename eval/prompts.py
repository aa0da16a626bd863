"""Evaluation prompt sets, read from files.

Sources (`prompts.source`):
  - `question`: Spec-Bench / MT-bench `question.jsonl` rows `{question_id, category, turns: [str]}`;
  - `sharegpt`: JSONL rows `{conversations: [{from, value}]}` (user turns: from = human | user);
  - `openai`:   JSONL rows `{messages: [{role, content}]}` (user turns: role = user);
  - `holdout`:  the held-out prompts of a data-gen output folder (`prompts.path=<data-gen out>`):
    the conversations of the LAST `prompts.holdout` rows of its tokenized set, i.e. the rows
    `draftsmith train val_samples=<holdout>` holds out and never trains on (the demo does that).

Only the user turns are kept: the decoder writes every assistant turn itself, so a second turn
is conditioned on the decoder's own first answer (`prompts.multi_turn=true`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

from draftsmith import DraftsmithError

SOURCES = ("question", "sharegpt", "openai", "holdout")
USER_ROLES = ("human", "user")


@dataclass
class EvalPrompt:
    """One evaluation conversation: its user turns, in order."""

    id: str
    category: str
    turns: list[str]
    system: Optional[str] = None
    meta: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- row parsers

def _fail(path: Path, line: int, why: str) -> DraftsmithError:
    return DraftsmithError(f"{path}, line {line}: {why}.")


def _str_list(value, path: Path, line: int, key: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise _fail(path, line, f"`{key}` must be a non-empty list of strings")
    return value


def _parse_question(row: dict, path: Path, line: int) -> EvalPrompt:
    if "turns" not in row:
        raise _fail(path, line, "no `turns` key (Spec-Bench / MT-bench rows have question_id, category, turns)")
    turns = _str_list(row["turns"], path, line, "turns")
    category = row.get("category", "default")
    if not isinstance(category, str):
        raise _fail(path, line, "`category` must be a string")
    return EvalPrompt(id=str(row.get("question_id", line)), category=category, turns=turns)


def _parse_chat(row: dict, path: Path, line: int, key: str, role_key: str, text_key: str) -> EvalPrompt:
    messages = row.get(key)
    if not isinstance(messages, list) or not messages:
        raise _fail(path, line, f"no `{key}` list")
    turns, system = [], None
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get(role_key), str) or not isinstance(m.get(text_key), str):
            raise _fail(path, line, f"`{key}[{i}]` needs string `{role_key}` and `{text_key}` keys")
        if m[role_key] in USER_ROLES:
            turns.append(m[text_key])
        elif m[role_key] == "system" and not turns:
            system = m[text_key]
    if not turns:
        raise _fail(path, line, f"`{key}` has no user turn")
    category = row.get("category", "default")
    return EvalPrompt(id=str(row.get("id", line)), category=str(category), turns=turns, system=system)


PARSERS: dict[str, Callable[[dict, Path, int], EvalPrompt]] = {
    "question": _parse_question,
    "sharegpt": lambda row, p, n: _parse_chat(row, p, n, "conversations", "from", "value"),
    "openai": lambda row, p, n: _parse_chat(row, p, n, "messages", "role", "content"),
}


def read_jsonl(path: str | Path, source: str) -> list[EvalPrompt]:
    """Parse every non-blank line of a JSONL prompt file; a bad line raises naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise DraftsmithError(f"prompts.path={str(path)!r}: no such file.")
    parse = PARSERS[source]
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise _fail(path, lineno, f"not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise _fail(path, lineno, "a row must be a JSON object")
            prompts.append(parse(row, path, lineno))
    if not prompts:
        raise DraftsmithError(f"prompts.path={str(path)!r} has no prompts.")
    return prompts


def read_holdout(folder: str | Path, holdout: int) -> list[EvalPrompt]:
    """The prompts of the last `holdout` tokenized rows of a data-gen output (train's `val_samples`).

    Those are the rows `draftsmith train val_samples=<holdout>` never trains on. The rows are
    matched to conversations by id; without a tokenized/ folder, the last conversations are used.
    """
    from datasets import load_from_disk

    folder = Path(folder)
    conv_dir = folder / "conversations"
    if not conv_dir.is_dir():
        raise DraftsmithError(f"prompts.path={str(folder)!r} is not a data-gen output: it has no conversations/ folder.")
    ds = load_from_disk(str(conv_dir))
    key = next((k for k in ("messages", "conversations") if k in ds.column_names), None)
    if key is None:
        raise DraftsmithError(f"{conv_dir} has neither a `messages` nor a `conversations` column.")
    tok_dir = folder / "tokenized"
    ids = load_from_disk(str(tok_dir))["id"] if tok_dir.is_dir() else None
    n = len(ids) if ids is not None else len(ds)
    if not 0 < holdout < n:
        raise DraftsmithError(f"prompts.holdout={holdout} must be between 1 and {n - 1} (the data-gen output "
                              f"in {folder} has {n} samples).")
    if ids is not None:
        row_of = {str(i): r for r, i in enumerate(ds["id"])}
        rows = [row_of[str(i)] for i in ids[n - holdout:] if str(i) in row_of]
    else:
        rows = list(range(n - holdout, n))
    role_key, text_key = ("role", "content") if key == "messages" else ("from", "value")
    prompts = []
    for r in rows:
        row = ds[r]
        p = _parse_chat(row, conv_dir, r, key, role_key, text_key)
        p.id = str(row.get("id", r))
        p.category = str(row.get("category") or "self")
        prompts.append(p)
    return prompts


# --------------------------------------------------------------------------- sampling

def sample(prompts: list[EvalPrompt], n: Optional[int] = None, per_category: Optional[int] = None,
           categories: Optional[Iterable[str]] = None, seed: int = 0) -> list[EvalPrompt]:
    """Seeded subset, kept in file order: filter categories, then `per_category` of each, then `n` in all."""
    rng = random.Random(seed)
    index = list(range(len(prompts)))
    if categories:
        wanted = set(categories)
        unknown = wanted - {p.category for p in prompts}
        if unknown:
            raise DraftsmithError(f"prompts.categories has {sorted(unknown)}, not in the prompt file "
                                  f"(it has {sorted({p.category for p in prompts})}).")
        index = [i for i in index if prompts[i].category in wanted]
    if per_category is not None:
        groups: dict[str, list[int]] = {}
        for i in index:
            groups.setdefault(prompts[i].category, []).append(i)
        index = sorted(j for g in groups.values() for j in rng.sample(g, min(per_category, len(g))))
    if n is not None and n < len(index):
        index = sorted(rng.sample(index, n))
    return [prompts[i] for i in index]


def load_prompts(cfg) -> list[EvalPrompt]:
    """Read and sample the prompt set named by an eval `prompts` config."""
    source = cfg.source
    if source not in SOURCES:
        hint = " (self-written prompts are for data-gen; evaluate on held-out ones with prompts.source=holdout)" \
            if source == "self" else ""
        raise DraftsmithError(f"prompts.source={source!r} is not one of {', '.join(SOURCES)}{hint}.")
    if not cfg.path or cfg.path == "???":
        raise DraftsmithError(f"prompts.source={source} needs prompts.path=<file or folder>.")
    for key in ("n", "per_category"):
        value = getattr(cfg, key)
        if value is not None and value < 1:
            raise DraftsmithError(f"prompts.{key}={value} must be at least 1 (or null for all).")
    prompts = read_holdout(cfg.path, cfg.holdout) if source == "holdout" else read_jsonl(cfg.path, source)
    prompts = sample(prompts, n=cfg.n, per_category=cfg.per_category, categories=cfg.categories, seed=cfg.seed)
    if not cfg.multi_turn:
        prompts = [EvalPrompt(p.id, p.category, p.turns[:1], p.system, p.meta) for p in prompts]
    return prompts


def render(tokenizer, prompt: EvalPrompt, answers: list[str]) -> list[int]:
    """Token ids of the conversation up to the next assistant turn: user turns interleaved with `answers`."""
    messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
    for i, answer in enumerate(answers):
        messages += [{"role": "user", "content": prompt.turns[i]}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": prompt.turns[len(answers)]})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
