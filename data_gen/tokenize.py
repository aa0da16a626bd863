"""Tokenization with assistant-only loss masks.

The conversation is rendered once with the chat template and tokenized with character offsets.
Each assistant turn's content is located in the rendered text by rendering the prefix
`messages[:k]` with the generation prompt (the template's own header for turn k), falling back
to a search from the previous turn's end for templates that re-render history. A token gets
loss 1 when it starts inside an assistant content span, and so does the end-of-turn token that
immediately follows the span (e.g. `<|im_end|>`). Everything else — system, user, the
`<|im_start|>assistant\\n` header, the newline after `<|im_end|>` — gets 0.
"""

from __future__ import annotations

import re

import jinja2
import jinja2.exceptions as jx

from ..core import DraftsmithError

THINK = re.compile(r"<think>.*?</think>\s*", flags=re.DOTALL)


def apply_chat_template(tokenizer, messages: list[dict], **kwargs):
    """`tokenizer.apply_chat_template` (transformers renders it in Jinja's sandbox): the one place draftsmith renders
    a chat template, so that a template that raises, does not parse, passes the sandbox's limits or tries to leave
    it is one sentence naming the template's file (`draftsmith_template_source`, set when the target loads)."""
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except (jinja2.TemplateError, OverflowError, RecursionError) as e:
        raise DraftsmithError(template_error(tokenizer, e)) from None


def template_error(tokenizer, e: Exception) -> str:
    source = getattr(tokenizer, "draftsmith_template_source", None) or "the tokenizer's chat_template"
    text = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, jx.TemplateSyntaxError):
        why = f"does not parse (line {e.lineno}: {text})"
    elif isinstance(e, jx.SecurityError):
        why = f"tried to reach past Jinja's sandbox, which refused ({text})"
    elif isinstance(e, OverflowError):
        why = f"went past the sandbox's limits ({text})"
    elif isinstance(e, RecursionError):
        why = "recursed without end"
    else:
        why = f"raised an error: {text}"
    return f"the chat template in {source} {why}; fix that template or give another with target.chat_template=<file>."


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return apply_chat_template(tokenizer, messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def strip_reasoning(messages: list[dict]) -> list[dict]:
    """Remove `<think>...</think>` blocks from assistant turns."""
    return [{**m, "content": THINK.sub("", m["content"])} if m["role"] == "assistant" else m for m in messages]


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the (start, end) character span of each assistant content."""
    text = render(tokenizer, messages)
    spans, cursor = [], 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        content = m["content"]
        prefix = render(tokenizer, messages[:k], add_generation_prompt=True)
        if text.startswith(prefix) and text.startswith(content, len(prefix)) and len(prefix) >= cursor:
            start = len(prefix)
        else:
            start = text.find(content, cursor)
            if start < 0:
                raise ValueError(f"assistant turn {k} is not found verbatim in the rendered template")
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict], end_ids: set[int]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask): 1 on assistant content tokens and the end-of-turn token after each."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    i = 0
    for start, end in spans:
        while i < len(ids) and offsets[i][0] < start:
            i += 1
        while i < len(ids) and offsets[i][0] < end:
            mask[i] = 1
            i += 1
        if i < len(ids) and ids[i] in end_ids:
            mask[i] = 1
            i += 1
    return ids, mask


def tokenize_samples(samples: list[dict], tokenizer, end_ids, max_length: int, on_overflow: str = "truncate",
                     reasoning: str = "keep") -> tuple[list[dict], dict]:
    """Tokenize conversations into rows {id, input_ids, loss_mask}; returns (rows, counts)."""
    if on_overflow not in ("truncate", "drop"):
        raise DraftsmithError(f"on_overflow={on_overflow!r} is not one of truncate, drop.")
    if reasoning not in ("keep", "strip"):
        raise DraftsmithError(f"reasoning={reasoning!r} is not one of keep, strip.")
    end_ids = set(end_ids)
    rows, counts = [], {"truncated": 0, "dropped": 0, "failed": 0}
    for s in samples:
        messages = strip_reasoning(s["messages"]) if reasoning == "strip" else s["messages"]
        try:
            ids, mask = tokenize_conversation(tokenizer, messages, end_ids)
        except ValueError:
            counts["failed"] += 1
            continue
        if len(ids) > max_length:
            if on_overflow == "drop":
                counts["dropped"] += 1
                continue
            ids, mask = ids[:max_length], mask[:max_length]
            counts["truncated"] += 1
        if not any(mask):
            counts["dropped"] += 1
            continue
        row = {"id": s["id"], "input_ids": ids, "loss_mask": mask}
        if "order" in s:  # prompt index, kept while rank parts are merged
            row["order"] = s["order"]
        rows.append(row)
    return rows, counts
