"""Dynamic draft length (`drafting.stop_below`, llama.cpp's --spec-draft-p-min rule): a chain stops before its first
depth whose drafter top probability is below the threshold (an unsure first depth: an empty draft), no drafter step
is spent past it, and decoding stays lossless (greedy token-identical to
target-only; sampled output has the target's distribution, with the negative control failing)."""

import pytest
import torch
from helpers import (chi2_pvalue, draft_llama, eagle3_head_f64, exact_joint, peagle_head_f64, repetitive_prompt,
                     sampled_joint_and_proposed, sampling_llama, sampling_proposer)

from draftsmith.core import DraftsmithError
from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.eval import decoder
from draftsmith.eval.decoder import DraftingConfig, SamplingConfig, speculative_generate
from draftsmith.eval.proposers.peagle import PEagleProposer
from draftsmith.eval.proposers.draft import DraftModelProposer
from draftsmith.eval.proposers.eagle3 import Eagle3Proposer
from draftsmith.eval.proposers.kit import ModelProposer, sample_chain
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.core.sampling import process_logits

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

K = 4
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def tiny(one_thread):
    target = load_target(TargetConfig(name="tiny", dtype="float64"))
    return target, TargetRunner(target.model, 256, target.aux_layer_ids)


def _recording(cls):
    """A proposer class that keeps, per draft: its tokens and the drafter's logits at each depth it computed."""

    class Recording(cls):
        rounds: list

        def propose(self, drafting, sampling, generator=None):
            self._rows = [] if cls is PEagleProposer else [self._root_logits.clone()]
            draft = super().propose(drafting, sampling, generator)
            self.rounds.append((draft.tokens, self._rows))
            return draft

        def _expand(self, nodes, tokens, parents, depth):  # EAGLE-3 and the draft model: one row per depth
            logits = super()._expand(nodes, tokens, parents, depth)
            self._rows.append(logits[0].clone())
            return logits

        def _forward(self, k):  # P-EAGLE: all K rows from one forward
            logits = super()._forward(k)
            self._rows.extend(logits.clone())
            return logits

    return Recording


def _make(kind, target, record=False):
    V = target.vocab_size
    if kind == "eagle3":
        cls = _recording(Eagle3Proposer) if record else Eagle3Proposer
        return cls(eagle3_head_f64(target), V, 256)
    if kind == "draft_model":
        cls = _recording(DraftModelProposer) if record else DraftModelProposer
        return cls(draft_llama(V, 1), V, 256)
    cls = _recording(PEagleProposer) if record else PEagleProposer
    return cls(peagle_head_f64(target), V, 256)


def _median_top_prob(runner, proposer, prompts):
    """The median of the drafter's top-1 probabilities over fixed-K greedy runs: a threshold that cuts some
    chains short and lets others run to K (the random tiny drafters are flat, near 1/V)."""
    seen = []
    real = DraftingConfig.stops_at

    def spy(self, prob):
        seen.append(prob)
        return real(self, prob)

    DraftingConfig.stops_at = spy
    try:
        for prompt in prompts:
            speculative_generate(runner, proposer, prompt, 40, GREEDY, DraftingConfig("chain", K, stop_below=1e-12), [])
    finally:
        DraftingConfig.stops_at = real
    return float(torch.tensor(seen).median())


@pytest.mark.parametrize("kind", ["eagle3", "draft_model", "peagle"])
def test_chain_stops_before_the_first_unsure_depth_and_greedy_is_token_identical(tiny, kind):
    target, runner = tiny
    prompts = [repetitive_prompt(seed=s) for s in range(3)]
    proposer = _make(kind, target, record=True)
    proposer.rounds = []
    threshold = _median_top_prob(runner, proposer, prompts)
    drafting = DraftingConfig("chain", K, stop_below=threshold)
    lengths = []
    for prompt in prompts:
        ref = speculative_generate(runner, None, prompt, 40, GREEDY, DraftingConfig(), []).tokens
        proposer.rounds = []
        res = speculative_generate(runner, proposer, prompt, 40, GREEDY, drafting, [])
        assert res.tokens == ref  # lossless
        for tokens, rows in proposer.rounds:
            probs = [float(row.double().softmax(-1).max()) for row in rows]
            first_unsure = next((d for d, p in enumerate(probs[:K]) if p < threshold), K)
            assert len(tokens) == first_unsure, (probs, threshold)
            if kind != "peagle":  # one drafter step per depth up to the unsure one, none past it
                assert len(rows) == min(len(tokens) + 1, K)
            lengths.append(len(tokens))
    # the threshold emptied some drafts (an unsure first depth) and let others run to K
    assert 0 in lengths and K in lengths, sorted(set(lengths))


def test_stop_below_zero_drafts_k_tokens(tiny):
    target, runner = tiny
    proposer = _make("eagle3", target, record=True)
    proposer.rounds = []
    speculative_generate(runner, proposer, repetitive_prompt(), 30, GREEDY, DraftingConfig("chain", K), [])
    assert proposer.rounds and all(len(tokens) == K for tokens, _ in proposer.rounds[:-1])


@pytest.mark.parametrize("kw", [dict(stop_below=-0.1), dict(stop_below=1.0),
                                dict(mode="tree", stop_below=0.5)])
def test_bad_stop_below(kw):
    with pytest.raises(DraftsmithError, match="stop_below"):
        DraftingConfig(**kw)


def test_eval_config_passes_stop_below(compose_cfg):
    from draftsmith.eval.config import build_settings

    cfg = compose_cfg("eval", "head=ngram", "prompts.path=x.jsonl", "drafting.stop_below=0.3")
    assert build_settings(cfg)[1].stop_below == 0.3


# ---- sampling: the distribution test of tests/test_decoder_sampling.py, with dynamic chains -----------------

# thresholds between the drafters' q(x) quantiles on this setup, so that both chain lengths occur
SAMPLING_CASES = {
    "eagle3-T1": ("eagle3", SamplingConfig(temperature=1.0), 0.95),
    "draft_model-T1": ("draft_model", SamplingConfig(temperature=1.0), 0.95),
    "draft_model-topk-topp": ("draft_model", SamplingConfig(temperature=0.8, top_k=5, top_p=0.9), 0.95),
    "peagle-T1": ("peagle", SamplingConfig(temperature=1.0), 0.7),
}


def _pvalue(case):
    kind, sampling, threshold = SAMPLING_CASES[case]
    target = sampling_llama(0, 60)
    runner = TargetRunner(target, 32, [0, 1, 1])
    counts, proposed = sampled_joint_and_proposed(runner, sampling_proposer(kind, target), sampling,
                                  DraftingConfig("chain", 2, stop_below=threshold))
    assert 0 < proposed[1] < proposed[0], proposed  # both chain lengths (1 and 2) were drafted
    return chi2_pvalue(counts, exact_joint(target, sampling))


@pytest.mark.slow  # 2500 seeded generations each
@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_dynamic_sampling_matches_target_distribution(case):
    pval, stat, df = _pvalue(case)
    print(f"{case}: chi2={stat:.1f} df={df} p={pval:.3g}")
    assert pval > 1e-3, (case, stat, df)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["eagle3-T1", "peagle-T1"])
def test_dynamic_negative_control_resampling_from_p_fails(case, monkeypatch):
    """A wrong sampler (on rejection, resample from p instead of the residual) must fail the same test."""
    monkeypatch.setattr(decoder, "residual_distribution", lambda p, q: p)
    pval, stat, df = _pvalue(case)
    print(f"wrong sampler {case}: chi2={stat:.1f} df={df} p={pval:.3g}")
    assert pval < 1e-4, (case, stat, df)


def test_sampled_chain_keeps_the_q_it_was_drawn_from(tiny):
    """Cutting a sampled chain keeps each kept token's q row unchanged: q of depth d is the drafter's own."""
    target, runner = tiny
    proposer = _make("draft_model", target, record=True)
    proposer.rounds = []
    sampling = SamplingConfig(temperature=1.0)
    drafts = []
    real = proposer.propose

    def keep(drafting, s, generator=None):
        d = real(drafting, s, generator)
        drafts.append(d)
        return d

    proposer.propose = keep
    g = torch.Generator().manual_seed(0)
    speculative_generate(runner, proposer, repetitive_prompt(), 30, sampling,
                         DraftingConfig("chain", K, stop_below=0.005), [], generator=g)
    assert any(0 < len(d.tokens) < K for d in drafts)
    for d, (_, rows) in zip(drafts, proposer.rounds):
        assert len(rows) == min(len(d.tokens) + 1, K)  # the unsure depth's row was computed, its token not drawn
        if not d.tokens:
            continue
        assert d.q.shape[0] == len(d.tokens)
        for i, row in enumerate(rows[:len(d.tokens)]):
            torch.testing.assert_close(d.q[i], process_logits(row, sampling))


# ---- the rule itself, on scripted drafter rows: a cut in the middle, at the first depth, and none -------------

def _row(top: float, vocab: int = 4, winner: int = 1) -> torch.Tensor:
    """Logits whose softmax gives `winner` probability `top` and the rest the remainder evenly."""
    p = torch.full((vocab,), (1 - top) / (vocab - 1), dtype=torch.float64)
    p[winner] = top
    return p.log()


class _Scripted(ModelProposer):
    """A ModelProposer whose drafter row at depth d is rows[d - 1] (its own vocab = the target's)."""

    def __init__(self, rows):
        self.rows, self._root_logits, self.expanded = rows, rows[0], 0

    def _expand(self, nodes, tokens, parents, depth):
        self.expanded += 1
        return self.rows[depth][None]

    def _to_target(self, own):
        return own

    def _q_target(self, probs):
        return probs


@pytest.mark.parametrize("tops, kept", [([0.9, 0.8, 0.3, 0.9], 2), ([0.3, 0.9, 0.9, 0.9], 0),
                                        ([0.9, 0.9, 0.9, 0.9], 4), ([0.9, 0.9, 0.9, 0.49], 3)])
@pytest.mark.parametrize("sampled", [False, True])
def test_the_chain_stops_before_the_first_depth_whose_top_probability_is_below(tops, kept, sampled):
    rows = [_row(t) for t in tops]
    drafting = DraftingConfig("chain", K, stop_below=0.5)
    sampling = SamplingConfig(temperature=1.0) if sampled else GREEDY
    g = torch.Generator().manual_seed(0)
    proposer = _Scripted(rows)
    chain = proposer.propose(drafting, sampling, g)  # one drafter row per depth
    assert len(chain.tokens) == kept and proposer.expanded == min(kept, K - 1)
    block = sample_chain(torch.stack(rows), torch.arange(4), 4, drafting, sampling, g)  # all K rows at once
    assert len(block.tokens) == kept and block.parents == list(range(-1, kept - 1))
    for draft in (chain, block):
        if not sampled:
            assert draft.tokens == [1] * kept and draft.q is None
        elif kept:  # each kept depth carries the q it was drawn from, whatever was drawn
            assert draft.q.shape[0] == kept
            torch.testing.assert_close(draft.q.double(), torch.stack(rows[:kept]).softmax(-1))
        else:
            assert draft.q is None
