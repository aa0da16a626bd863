"""Greedy speculative decoding is token-identical to target-only greedy and to HF generate."""

import pytest
import torch
from helpers import draft_llama, eagle3_head_f64, repetitive_prompt

from draftsmith.core import DraftsmithError
from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.eval.decoder import DraftingConfig, SamplingConfig, speculative_generate
from draftsmith.eval.proposers.draft import DraftModelProposer
from draftsmith.eval.proposers.eagle3 import Eagle3Proposer
from draftsmith.eval.proposers.ngram import NgramProposer
from draftsmith.eval.target_runner import TargetRunner

GREEDY = SamplingConfig()
CHAIN = DraftingConfig(mode="chain", num_speculative_tokens=4)
TREE = DraftingConfig(mode="tree", num_speculative_tokens=4, tree_top_k=3, tree_budget=10)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny(one_thread):
    target = load_target(TargetConfig(name="tiny", dtype="float64"))
    return target, TargetRunner(target.model, 256, target.aux_layer_ids)


def _self_draft(target):
    """A draft model identical to the target: every draft is accepted (exercises the bonus path)."""
    return DraftModelProposer(target.model, target.vocab_size, 256)


def _proposers(target):
    return {
        "ngram": NgramProposer(ngram_max=3, ngram_min=1),
        "eagle3": Eagle3Proposer(eagle3_head_f64(target), target.vocab_size, 256),
        "eagle3_all_norms": Eagle3Proposer(eagle3_head_f64(target, norm_before_fc=True, fc_norm=True, norm_output=True),
                                           target.vocab_size, 256),  # EAGLE-3.1's norms
        "draft_model": DraftModelProposer(draft_llama(target.vocab_size, 1), target.vocab_size, 256),
        "self": _self_draft(target),
    }


@pytest.mark.parametrize("drafting", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_matches_target_only_and_hf_generate(tiny, drafting):
    target, runner = tiny
    proposers = _proposers(target)
    for seed in range(3):
        prompt = repetitive_prompt(seed=seed)
        ref = speculative_generate(runner, None, prompt, 40, GREEDY, drafting, eos_token_ids=[])
        hf = target.model.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                                   max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ref.tokens == hf[0, prompt.numel():].tolist()
        assert ref.n_verifications == 39
        for name, proposer in proposers.items():
            res = speculative_generate(runner, proposer, prompt, 40, GREEDY, drafting, eos_token_ids=[])
            assert res.tokens == ref.tokens, (name, seed)
            assert len(res.tokens) == 40
            if name == "self":
                assert res.n_verifications < 39 / 3


def test_eos_and_max_new_tokens_truncate_exactly(tiny):
    target, runner = tiny
    prompt = repetitive_prompt()
    ref = speculative_generate(runner, None, prompt, 30, GREEDY, CHAIN, eos_token_ids=[])
    eos = ref.tokens[7]
    first = ref.tokens.index(eos)
    self_draft = _self_draft(target)
    for proposer in (None, self_draft):
        res = speculative_generate(runner, proposer, prompt, 30, GREEDY, CHAIN, eos_token_ids=[eos])
        assert res.tokens == ref.tokens[: first + 1]
        for n in (1, 2, 5, 13):
            res = speculative_generate(runner, proposer, prompt, n, GREEDY, CHAIN, eos_token_ids=[])
            assert res.tokens == ref.tokens[:n]


def test_stats_are_consistent(tiny):
    target, runner = tiny
    prompt = repetitive_prompt()
    res = speculative_generate(runner, _self_draft(target), prompt, 21,
                               GREEDY, CHAIN, eos_token_ids=[])
    assert sum(res.emitted_per_verification) + 1 == len(res.tokens) == 21
    assert res.accepted_per_position == res.proposed_per_position  # a perfect drafter
    assert res.tau > 4


@pytest.mark.parametrize("kw", [dict(num_speculative_tokens=0), dict(num_speculative_tokens=1000),
                                dict(mode="beam"), dict(mode="tree", tree_top_k=0),
                                dict(mode="tree", tree_budget=0)])
def test_bad_drafting_config(kw):
    with pytest.raises(DraftsmithError):
        DraftingConfig(**kw)


def test_bad_inputs(tiny):
    target, runner = tiny
    with pytest.raises(DraftsmithError):
        SamplingConfig(temperature=-1)
    with pytest.raises(DraftsmithError):
        SamplingConfig(top_p=0)
    with pytest.raises(DraftsmithError):
        NgramProposer(ngram_max=1, ngram_min=2)
    with pytest.raises(DraftsmithError):  # a head for another vocabulary
        Eagle3Proposer(eagle3_head_f64(target), target.vocab_size + 1, 64)
    with pytest.raises(DraftsmithError):
        speculative_generate(runner, None, torch.tensor([1, 2]), 10_000, GREEDY, CHAIN, eos_token_ids=[])
    no_aux = TargetRunner(target.model, 64, None)
    with pytest.raises(DraftsmithError):
        speculative_generate(no_aux, Eagle3Proposer(eagle3_head_f64(target), target.vocab_size, 64),
                             torch.tensor([1, 2]), 4, GREEDY, CHAIN, eos_token_ids=[])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_runner_matches_hf_forward_across_families(family):
    """Chunked prefill + one-token steps + a tree pass reproduce the unmodified HF forward's logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).double().eval()
    ids = torch.randint(0, 50, (12,))
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    runner = TargetRunner(model, 32, [1, 2, 3])
    a, _ = runner.forward(ids[:7], torch.arange(7), 0)
    b, _ = runner.forward(ids[7:8], torch.arange(7, 8), 7)
    # a tree: root ids[8] with two children (a wrong token first, then ids[9]); ids[10..11] follow as a chain
    from draftsmith.eval.decoder import tree_mask
    toks = torch.tensor([ids[8], (ids[9] + 1) % 50, ids[9]])
    c, _ = runner.forward(toks, torch.tensor([8, 9, 9]), 8, attn_mask=tree_mask([-1, -1], 8))
    runner.gather([10], 9)
    d, _ = runner.forward(ids[10:12], torch.arange(10, 12), 10)
    got = torch.cat([a, b, c[[0, 2]], d])
    assert torch.allclose(got, ref, atol=1e-10)


# ---- fp32 on a CPU: verification passes take the weight-first product ----------------------------------------

@pytest.mark.parametrize("shape,bias", [((3, 16), True), ((1, 5, 16), False)], ids=["2d-bias", "3d"])
def test_weight_first_linear_is_linear(shape, bias):
    from draftsmith.eval.target_runner import weight_first_linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 24, bias=bias)
    x = torch.randn(*shape)
    got = weight_first_linear(lin.weight, lin.bias, x)
    assert got.shape == (*shape[:-1], 24)
    torch.testing.assert_close(got, lin(x), rtol=1e-5, atol=1e-6)


def test_fp32_runner_verifies_weight_first_and_leaves_the_model_as_it_came(monkeypatch, one_thread):
    """A 2..8-token pass of an fp32 CPU target runs its linears weight first (same logits within fp32 rounding);
    one-token steps do not; afterwards, and after a pass that raises, no module keeps the swapped forward."""
    from draftsmith.eval import target_runner as tr

    calls = []
    monkeypatch.setattr(tr, "weight_first_linear", lambda w, b, x: calls.append(x.shape) or torch.nn.functional.linear(x, w, b))
    target = load_target(TargetConfig(name="tiny", dtype="float32"))
    linears = [m for m in target.model.modules() if type(m) is torch.nn.Linear]
    runner = TargetRunner(target.model, 64, target.aux_layer_ids)
    assert runner.weight_first and len(linears) > 0
    ids = torch.randint(0, target.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    runner.forward(ids[:8], torch.arange(8), 0)  # 8 tokens: weight first
    assert len(calls) == len(linears)
    calls.clear()
    runner.forward(ids[8:9], torch.arange(8, 9), 8)  # one token: torch's linear
    assert calls == []
    runner.forward(ids[:12], torch.arange(12), 0)  # 12 tokens (prefill): torch's linear
    assert calls == [] and not any("forward" in m.__dict__ for m in linears)
    with pytest.raises(ValueError):
        runner.forward(ids[:4], torch.arange(4), 62)  # overflows the cache before any linear runs
    monkeypatch.setattr(runner, "_run", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        runner.forward(ids[:4], torch.arange(4), 0)
    assert not any("forward" in m.__dict__ for m in linears)


def test_fp32_weight_first_verification_stays_greedy_identical(one_thread):
    """fp32 on a CPU: speculative decoding (verify weight first) gives target-only greedy's tokens, and the
    weight-first logits of a pass equal torch's linear within fp32 rounding."""
    target = load_target(TargetConfig(name="tiny", dtype="float32"))
    runner = TargetRunner(target.model, 256, target.aux_layer_ids)
    ids = repetitive_prompt()
    a, _ = runner.forward(ids[:6], torch.arange(6), 0)
    runner.weight_first = False
    b, _ = runner.forward(ids[:6], torch.arange(6), 0)
    runner.weight_first = True
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    ref = speculative_generate(runner, None, ids, 40, GREEDY, CHAIN, eos_token_ids=[])
    proposers = {"ngram": NgramProposer(ngram_max=3, ngram_min=1), "self": _self_draft(target)}
    for name, proposer in proposers.items():
        got = speculative_generate(runner, proposer, ids, 40, GREEDY, CHAIN, eos_token_ids=[])
        assert got.tokens == ref.tokens and got.n_verifications < ref.n_verifications, name
