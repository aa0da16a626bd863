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

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from datasets import load_from_disk

from ..core import DraftsmithError
from ..data_gen.prompts import from_openai, from_sharegpt, read_conversations, skipped_text, with_user_turn
from ..data_gen.tokenize import apply_chat_template

SOURCES = ("question", "sharegpt", "openai", "holdout")


@dataclass
class EvalPrompt:
    """One evaluation conversation: its user turns, in order."""

    id: str
    category: str
    turns: list[str]
    system: Optional[str] = None
    meta: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- readers

def _from_messages(messages: list[dict], where: Path, line: int) -> tuple[list[str], Optional[str]]:
    """(user turns, leading system message) of `{role, content}` messages; no user turn is an error."""
    turns = [m["content"] for m in messages if m["role"] == "user"]
    if not turns:
        raise DraftsmithError(f"{where}, line {line}: the conversation has no user turn.")
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    return turns, system


def read_jsonl(path: str | Path, source: str) -> list[EvalPrompt]:
    """Parse every non-blank line of a JSONL prompt file (data-gen's readers); a bad line names file and line.

    A record without a user turn is skipped and reported, as data-gen does (`with_user_turn`).
    """
    path = Path(path)
    prompts: list[EvalPrompt] = []
    skipped: list[int] = []  # line numbers
    for record in with_user_turn(read_conversations(source, path), str(path), skipped):  # data-gen's rule
        turns, system = _from_messages(record["messages"], path, record["line"])
        prompts.append(EvalPrompt(id=record["id"], category=record["category"] or "default", turns=turns,
                                  system=system))
    if not prompts:
        why = f": {skipped_text(skipped, str(path))} were skipped" if skipped else ""
        raise DraftsmithError(f"prompts.path={str(path)!r} has no prompts{why}.")
    return prompts


def read_holdout(folder: str | Path, holdout: int) -> list[EvalPrompt]:
    """The prompts of the last `holdout` tokenized rows of a data-gen output (train's `val_samples`).

    Those are the rows `draftsmith train val_samples=<holdout>` never trains on. The rows are
    matched to conversations by id; without a tokenized/ folder, the last conversations are used.
    """
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
    convert = from_openai if key == "messages" else from_sharegpt
    prompts = []
    for r in rows:
        row = ds[r]
        turns, system = _from_messages(convert(row), conv_dir, r)
        prompts.append(EvalPrompt(id=str(row.get("id", r)), category=str(row.get("category") or "self"),
                                  turns=turns, system=system))
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
    ids = apply_chat_template(tokenizer, messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
