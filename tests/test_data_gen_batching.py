"""Continuous batching (data_gen/batching.py): refilled rows give each prompt the tokens it gets alone."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from draftsmith.core import DraftsmithError
from draftsmith.data_gen import batching
from draftsmith.data_gen.batching import check_window, generate_tokens
from draftsmith.data_gen.regenerate import SamplingParams

MAX_NEW = 24


@pytest.fixture(scope="module")
def tiny64():
    """The tiny target in float64, where a batch's shared matmuls cannot round a greedy choice differently."""
    from draftsmith.data_gen.target import TargetConfig, load_target

    return load_target(TargetConfig(name="tiny", dtype="float64"))


def prompts_of(target, n: int) -> list[list[int]]:
    tok = target.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": "ab" * (1 + k % 5) + str(k)}], tokenize=False,
                                     add_generation_prompt=True) for k in range(n)]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def with_eos(target, eos: list[int]):
    """The target with other end tokens: the random tiny model never says its own EOS, so answers
    would all end at max_new_tokens together and no row would be refilled mid-run."""
    return SimpleNamespace(model=target.model, device=target.device, dtype=target.dtype, eos_token_ids=eos,
                           tokenizer=target.tokenizer)


GREEDY_PARAMS = SamplingParams(max_new_tokens=MAX_NEW)  # varied_eos's default (one object: never changed)


def varied_eos(target, prompts, params=GREEDY_PARAMS, seeds=None) -> list[int]:
    """A token whose first occurrence in the answers falls at the most different steps."""
    free = generate_tokens(with_eos(target, []), prompts, params, seeds or [0] * len(prompts), batch_size=1)
    first_steps: dict[int, set[int]] = {}
    for out, _ in free:
        for t in set(out):
            first_steps.setdefault(t, set()).add(out.index(t))
    return [max(first_steps, key=lambda t: (len(first_steps[t]), -t))]


def hf_alone(target, prompt: list[int], eos: list[int]) -> tuple[list[int], str]:
    """The reference: transformers' generate on this prompt alone, greedy."""
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                eos_token_id=eos, pad_token_id=target.tokenizer.pad_token_id)[0, len(prompt):].tolist()
    end = next((k for k, t in enumerate(out) if t in eos), None)
    return (out, "length") if end is None else (out[:end], "stop")


def count_decode_steps(monkeypatch) -> list[int]:
    """Spy on RowCache.update: one call per layer per decode step; returns [steps] (filled as it runs)."""
    calls = [0]
    update = batching.RowCache.update

    def counting(self, key, value, layer_idx, *args, **kwargs):
        calls[0] += layer_idx == 0
        return update(self, key, value, layer_idx, *args, **kwargs)

    monkeypatch.setattr(batching.RowCache, "update", counting)
    return calls


def test_refilled_rows_equal_generating_alone(tiny64, monkeypatch):
    prompts = prompts_of(tiny64, 11)
    eos = varied_eos(tiny64, prompts)
    target = with_eos(tiny64, eos)
    alone = [hf_alone(tiny64, p, eos) for p in prompts]
    ends = [len(out) for out, _ in alone]
    assert len(set(ends)) >= 4 and Counter(f for _, f in alone)["stop"] >= 5  # answers end at many steps

    params = SamplingParams(max_new_tokens=MAX_NEW)
    steps = count_decode_steps(monkeypatch)
    refilled = generate_tokens(target, prompts, params, [0] * 11, batch_size=4)
    refill_steps, steps[0] = steps[0], 0
    fixed = generate_tokens(target, prompts, params, [0] * 11, batch_size=4, prune=False)
    assert refilled == alone
    assert fixed == alone
    # rows were refilled mid-run: fewer steps than batches that wait for their longest answer
    assert refill_steps < steps[0]


def test_sampling_per_prompt_whatever_the_batch(tiny64):
    prompts = prompts_of(tiny64, 9)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=MAX_NEW)
    seeds = [1000 + k for k in range(9)]
    target = with_eos(tiny64, varied_eos(tiny64, prompts, params, seeds))
    refilled = generate_tokens(target, prompts, params, seeds, batch_size=3)
    assert len({len(out) for out, _ in refilled}) >= 3  # rows finish apart, so rows are refilled
    alone = [generate_tokens(target, [p], params, [s], batch_size=1)[0] for p, s in zip(prompts, seeds)]
    shuffled = list(reversed(range(9)))  # other neighbours in every row
    other_order = generate_tokens(target, [prompts[i] for i in shuffled], params, [seeds[i] for i in shuffled], 4)
    assert refilled == alone == [other_order[shuffled.index(i)] for i in range(9)]
    assert generate_tokens(target, prompts, params, [s + 1 for s in seeds], batch_size=3) != refilled


def test_done_called_once_per_prompt(tiny64):
    prompts = prompts_of(tiny64, 7)
    target = with_eos(tiny64, varied_eos(tiny64, prompts))
    seen = []
    generate_tokens(target, prompts, SamplingParams(max_new_tokens=MAX_NEW), [0] * 7, batch_size=3, done=seen.append)
    assert sorted(seen) == list(range(7))


def test_no_prompts():
    assert generate_tokens(None, [], SamplingParams(), []) == []


def test_sliding_window_reaching_the_answer_is_refused():
    check_window(SimpleNamespace(sliding_window=None), 10_000)
    check_window(SimpleNamespace(sliding_window=4096, use_sliding_window=False), 10_000)  # Qwen2: off
    check_window(SimpleNamespace(sliding_window=4096), 4095)
    with pytest.raises(DraftsmithError, match="sliding window of 4096 tokens"):
        check_window(SimpleNamespace(sliding_window=4096), 4096)


def test_prefill_hands_the_lm_head_a_contiguous_last_position(tiny64):
    """The prefill's logits: the lm_head reads a contiguous (B, 1, H) copy of the last position, equal to the full
    forward's last row. (logits_to_keep=1 hands it a strided view, on which torch 2.13's CPU linear copies the weight
    once per row: seconds per bf16 prefill of 64 prompts; benchmarks/bench_cpu_linear.py.)"""
    target = tiny64
    first = prompts_of(target, 1)[0]
    prompts = [first, first[:-2] + first[-1:] + first[-2:-1]]  # two rows of one length: one group, no padding
    seen = []
    hook = target.model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].is_contiguous()))
    try:
        cache = batching.RowCache(len(prompts), len(prompts[0]) + 1)
        logits = batching.prefill_group(target.model, cache, list(range(len(prompts))), prompts, target.device)
    finally:
        hook.remove()
    assert seen == [True]
    full = target.model(input_ids=torch.tensor(prompts)).logits[:, -1]
    torch.testing.assert_close(logits, full)
