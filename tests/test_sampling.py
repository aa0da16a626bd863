"""One sampling rule (draftsmith.core.sampling) for data-gen and eval: top-p's boundary, top-k, seeds."""

import pytest
import torch

from draftsmith.core import DraftsmithError
from draftsmith.data_gen.batching import sample_next
from draftsmith.data_gen.regenerate import SamplingParams
from draftsmith.core.sampling import SamplingConfig, hash_seed, process_logits, top_p_drop


def kept(probs: torch.Tensor) -> int:
    return int((probs > 0).sum())


def test_top_p_keeps_the_smallest_set_reaching_top_p():
    uniform = torch.zeros(4)  # p = 1/4 each, exactly: cumulative 0.25, 0.5, 0.75, 1.0
    for top_p, n in [(0.25, 1), (0.3, 2), (0.5, 2), (0.75, 3), (0.76, 4), (1.0, 4)]:
        probs = process_logits(uniform, SamplingConfig(temperature=1.0, top_p=top_p))
        assert kept(probs) == n, top_p  # cumulative >= top_p stops the set: 0.5 keeps 2 tokens, not 3
        assert torch.allclose(probs[probs > 0], torch.full((n,), 1 / n, dtype=torch.float64))


def test_top_p_always_keeps_the_most_probable_token():
    logits = torch.tensor([[5.0, 1.0, 0.0], [0.0, 9.0, 1.0]])
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_p=1e-9))
    assert torch.equal(probs, torch.tensor([[1.0, 0, 0], [0, 1.0, 0]], dtype=torch.float64))


def test_top_k_then_top_p_and_temperature():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = process_logits(logits, SamplingConfig(temperature=1.0, top_k=3))
    assert kept(p) == 3 and torch.allclose(p[:3], logits[:3].double().softmax(-1))
    hot = process_logits(logits, SamplingConfig(temperature=0.5))
    assert torch.allclose(hot, (logits.double() / 0.5).softmax(-1))
    both = process_logits(logits, SamplingConfig(temperature=1.0, top_k=3, top_p=0.7))
    assert kept(both) == 2  # within the top 3 (renormalised: 0.665, 0.245, 0.090), two reach 0.7


def test_data_gen_samples_with_the_same_rule():
    """Regeneration's sampler draws only tokens process_logits keeps, with the same boundary."""
    logits = torch.zeros(64, 4)  # 64 rows of the uniform distribution
    params = SamplingParams(temperature=1.0, top_p=0.5, max_new_tokens=1)
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    allowed = process_logits(logits[0], params) > 0
    drawn = sample_next(logits, params, gens)
    assert allowed[drawn].all() and int(allowed.sum()) == 2
    assert torch.equal(sample_next(logits, SamplingParams(), gens), logits.argmax(-1))  # greedy



def _full_sort_rule(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """top-p written out with one sort of the whole row: what top_p_drop must equal."""
    sx, order = torch.sort(x.double(), dim=-1, descending=True)
    p = sx.softmax(-1)
    drop = p.cumsum(-1) - p >= top_p
    drop[..., 0] = False
    return drop.scatter(-1, order, drop)


def test_top_p_candidates_equal_a_full_sort():
    """Rows settled by the first 256 candidates, by 4096, and only by the whole row (V = 8192) keep exactly the
    tokens one sort of the row keeps."""
    torch.manual_seed(0)
    V = 8192
    rows = []
    for width in (20, 1000, 7000):  # the nucleus lies within ~width tokens of near-equal logits
        for _ in range(4):
            row = torch.full((V,), -30.0, dtype=torch.float64)
            row[torch.randperm(V)[:width]] = torch.randn(width, dtype=torch.float64) * 0.3
            rows.append(row)
    x = torch.stack(rows)
    for top_p in (0.5, 0.9, 0.99):
        drop = top_p_drop(x, top_p)
        assert torch.equal(drop, _full_sort_rule(x, top_p)), top_p
    kept = (~top_p_drop(x, 0.99)).sum(-1)  # every level is taken: under 256 tokens, within 256..4096, past 4096
    assert kept[:4].max() < 256 and 256 < kept[4:8].min() and kept[4:8].max() < 4096 < kept[8:].min()


def test_sample_next_draws_each_token_with_its_probability():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]).repeat(20000, 1)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=1)
    drawn = sample_next(logits, params, [torch.Generator().manual_seed(i) for i in range(20000)])
    p = process_logits(logits[0], params)
    freq = torch.bincount(drawn, minlength=5).double() / 20000
    assert freq[4] == 0 and torch.allclose(freq, p, atol=0.015)  # 4.5 sigma at p = 0.58
    # a row's draw comes from its own generator alone: the same in any batch
    alone = sample_next(logits[:1], params, [torch.Generator().manual_seed(7)])
    assert alone == drawn[7]


def test_ranges_and_seeds():
    for bad in (dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5)):
        with pytest.raises(DraftsmithError):
            SamplingConfig(**bad)
    assert SamplingConfig().greedy and not SamplingConfig(temperature=0.7).greedy
    assert hash_seed(0, "a", 1) == hash_seed(0, "a", 1) != hash_seed(0, "a", 2)
    assert 0 <= hash_seed(123, "self", 7) < 2 ** 63
