"""Assistant-only loss masks: exactly the assistant content and its end-of-turn token."""

from __future__ import annotations

import pytest

from draftsmith.data_gen.tokenize import tokenize_conversation, tokenize_samples

SINGLE = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}]
MULTI = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?\n"},
    {"role": "user", "content": "Say héllo in 日本語"},
    {"role": "assistant", "content": "こんにちは,  héllo <think>x</think> done."},
]


def masked_runs(tokenizer, ids, mask):
    """Decoded text of each maximal run of loss-masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    return runs + ([tokenizer.decode(cur)] if cur else [])


def check_masks(target, messages):
    # (a token straddling the header and the content, e.g. "\n " before content that starts
    # with a space in SmolLM2's BPE, starts in the header and stays 0)
    tok = target.tokenizer
    ids, mask = tokenize_conversation(tok, messages, set(target.eos_token_ids))
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    expected = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert masked_runs(tok, ids, mask) == expected
    # the header is never in the loss
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for start in range(len(ids) - len(header)):
        if ids[start:start + len(header)] == header:
            assert not any(mask[start:start + len(header)])


@pytest.mark.parametrize("messages", [SINGLE, MULTI], ids=["single", "multi"])
def test_masks_tiny(tiny_target, messages):
    check_masks(tiny_target, messages)


@pytest.mark.slow
@pytest.mark.parametrize("messages", [SINGLE, MULTI], ids=["single", "multi"])
def test_masks_smollm2(smollm2_target, messages):
    check_masks(smollm2_target, messages)


def test_reasoning_strip_and_keep(tiny_target):
    sample = {"id": "0", "messages": MULTI}
    tok = tiny_target.tokenizer
    [kept], _ = tokenize_samples([sample], tok, tiny_target.eos_token_ids, 4096, reasoning="keep")
    [stripped], _ = tokenize_samples([sample], tok, tiny_target.eos_token_ids, 4096, reasoning="strip")
    assert "<think>" in tok.decode(kept["input_ids"])
    last = masked_runs(tok, stripped["input_ids"], stripped["loss_mask"])[-1]
    assert last == "こんにちは,  héllo done.<|im_end|>"


def test_overflow_truncate_and_drop(tiny_target):
    tok, eos = tiny_target.tokenizer, tiny_target.eos_token_ids
    samples = [{"id": str(i), "messages": SINGLE} for i in range(2)]
    full = len(tokenize_conversation(tok, SINGLE, set(eos))[0])
    rows, counts = tokenize_samples(samples, tok, eos, full - 3, on_overflow="truncate")
    assert counts["truncated"] == 2 and all(len(r["input_ids"]) == full - 3 for r in rows)
    rows, counts = tokenize_samples(samples, tok, eos, full - 3, on_overflow="drop")
    assert rows == [] and counts["dropped"] == 2
    rows, counts = tokenize_samples(samples, tok, eos, 10, on_overflow="truncate")  # no loss token left
    assert rows == [] and counts == {"truncated": 2, "dropped": 2, "failed": 0}
