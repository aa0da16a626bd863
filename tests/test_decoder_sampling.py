"""Sampling is lossless: the analytic identity, and a seeded statistical test with a negative control."""

import pytest
import torch
from helpers import SAMPLING_V, chi2_pvalue, exact_joint, sampled_joint_counts, sampling_eagle3_head, sampling_llama

from draftsmith.eval import decoder
from draftsmith.eval.decoder import (DraftingConfig, SamplingConfig, accept_probability, process_logits,
                                     residual_distribution)
from draftsmith.eval.proposers.draft import DraftModelProposer
from draftsmith.eval.proposers.eagle3 import Eagle3Proposer
from draftsmith.eval.proposers.ngram import NgramProposer
from draftsmith.eval.target_runner import TargetRunner

V = SAMPLING_V  # tiny vocabulary: the joint of two generated tokens has 64 cells


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def setup():
    target = sampling_llama(0, 60)
    runner = TargetRunner(target, 32, [0, 1, 1])
    return target, runner


CASES = {
    "draft_model-chain-T1": ("draft_model", SamplingConfig(temperature=1.0), DraftingConfig("chain", 2)),
    "draft_model-chain-topk-topp": ("draft_model", SamplingConfig(temperature=0.8, top_k=5, top_p=0.9),
                                    DraftingConfig("chain", 2)),
    "eagle3-tree-T1": ("eagle3", SamplingConfig(temperature=1.0), DraftingConfig("tree", 2, 3, 6)),
    "eagle3-chain-T1": ("eagle3", SamplingConfig(temperature=1.0), DraftingConfig("chain", 2)),
    "ngram-chain-T1": ("ngram", SamplingConfig(temperature=1.0), DraftingConfig("chain", 2)),
}


def _proposer(kind, target):
    if kind == "ngram":
        return NgramProposer(ngram_max=3, ngram_min=1)
    if kind == "eagle3":
        return Eagle3Proposer(sampling_eagle3_head(target), V, 32)
    return DraftModelProposer(sampling_llama(1, 60), V, 32)


@pytest.mark.slow  # 2500 seeded generations each
@pytest.mark.parametrize("case", list(CASES))
def test_sampling_matches_target_distribution(setup, case):
    target, runner = setup
    kind, sampling, drafting = CASES[case]
    exact = exact_joint(target, sampling)
    counts, _ = sampled_joint_counts(runner, _proposer(kind, target), sampling, drafting)
    pval, stat, df = chi2_pvalue(counts, exact)
    tv = 0.5 * (counts / counts.sum() - exact).abs().sum()
    print(f"{case}: chi2={stat:.1f} df={df} p={pval:.3g} TV={tv:.3f}")
    assert pval > 1e-3, (case, stat, df, tv)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["draft_model-chain-T1", "eagle3-tree-T1"])
def test_negative_control_resampling_from_p_fails(setup, case, monkeypatch):
    """A wrong sampler (on rejection, resample from p instead of the residual) must fail the same test."""
    target, runner = setup
    kind, sampling, drafting = CASES[case]
    monkeypatch.setattr(decoder, "residual_distribution", lambda p, q: p)
    exact = exact_joint(target, sampling)
    counts, _ = sampled_joint_counts(runner, _proposer(kind, target), sampling, drafting)
    pval, stat, df = chi2_pvalue(counts, exact)
    print(f"wrong sampler {case}: chi2={stat:.1f} df={df} p={pval:.3g}")
    assert pval < 1e-4  # the correct sampler passes p > 1e-3 on the same seed


@pytest.mark.slow
def test_target_only_sampling_matches(setup):
    target, runner = setup
    sampling = SamplingConfig(temperature=1.0)
    counts, _ = sampled_joint_counts(runner, None, sampling, DraftingConfig())
    assert chi2_pvalue(counts, exact_joint(target, sampling))[0] > 1e-3


def _rule_output(p, q):
    """The exact output distribution of one accept/reject step with x ~ q."""
    acc = torch.tensor([accept_probability(p, q, x) for x in range(p.numel())], dtype=p.dtype)
    return q * acc + (1 - (q * acc).sum()) * residual_distribution(p, q)


def test_analytic_identity_q_accept_plus_reject_residual_is_p():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = 2 + trial % 30
        p = torch.rand(n, generator=g, dtype=torch.float64) ** 3
        q = torch.rand(n, generator=g, dtype=torch.float64) ** 3
        if trial % 3 == 0:
            q[torch.rand(n, generator=g) < 0.5] = 0  # q with holes (e.g. outside the draft vocab)
            q[0] += 0.1
        if trial % 5 == 0:
            q = torch.zeros(n, dtype=torch.float64).index_fill_(0, torch.tensor([trial % n]), 1.0)  # one-hot
        p, q = p / p.sum(), q / q.sum()
        assert torch.allclose(_rule_output(p, q), p, atol=1e-12)
    p = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    assert torch.allclose(_rule_output(p, p.clone()), p)  # p == q: never rejects


def test_process_logits_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = process_logits(logits, SamplingConfig(temperature=1.0, top_k=3))
    assert (p[3:] == 0).all() and torch.allclose(p[:3], logits[:3].double().softmax(-1))
    full = logits.double().softmax(-1)
    p = process_logits(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    k = int((full.cumsum(-1) < 0.8).sum()) + 1  # smallest prefix whose mass reaches 0.8
    assert (p[k:] == 0).all() and torch.allclose(p[:k], full[:k] / full[:k].sum())
