"""n-gram + head (`ngram_first=true`, eval/proposers/ngram.py NgramFirstProposer): drafts from a context match when
there is one and from the head otherwise; the head's state follows every emitted token even in n-gram cycles;
decoding stays lossless (greedy token-identical to target-only; the sampling distribution test with its negative
control)."""

import pytest
import torch

from draftsmith.core import DraftsmithError
from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.eval import decoder
from draftsmith.eval.decoder import Draft, DraftingConfig, SamplingConfig, speculative_generate
from draftsmith.eval.proposers.peagle import PEagleProposer
from draftsmith.eval.proposers.draft import DraftModelProposer
from draftsmith.eval.proposers.eagle3 import Eagle3Proposer
from draftsmith.eval.proposers.ngram import NgramFirstProposer, NgramProposer
from draftsmith.eval.target_runner import TargetRunner
from helpers import (AUX, EAGLE3_K, EAGLE3_V, Eagle3RecordingProposer, PEagleRecordingProposer, chi2_pvalue,
                     draft_llama, eagle3_decoder_features, eagle3_decoder_head, eagle3_decoder_target,
                     eagle3_head_f64, exact_joint, peagle_decoder_head, peagle_from_scratch, peagle_head_f64,
                     peaked_llama, repetitive_prompt, sampled_joint_and_proposed, sampling_llama, sampling_proposer,
                     save_tiny_head, ttt_unroll)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

GREEDY = SamplingConfig()
CHAIN = DraftingConfig("chain", 4)
TREE = DraftingConfig("tree", 4, 3, 10)


class FakeHead:
    """A head that drafts [7, 7] and records what it was told."""

    needs_aux = False

    def __init__(self):
        self.seen, self.proposed = [], 0

    def reset(self, prompt_ids):
        self.seen = list(prompt_ids)

    def update(self, tokens, aux):
        self.seen += tokens

    def propose(self, drafting, sampling, generator=None):
        self.proposed += 1
        return Draft([7, 7], [-1, 0])


def test_drafts_from_a_context_match_else_from_the_head():
    head = FakeHead()
    both = NgramFirstProposer(NgramProposer(3, 2), head)
    both.reset([1, 2, 3, 4])
    both.update([5], None)
    assert both.propose(CHAIN, GREEDY).tokens == [7, 7]  # no earlier (4, 5): the head drafts
    both.update([1, 2], None)  # ... 1 2 3 4 5 1 2: the suffix (1, 2) occurred before, followed by 3 4 5 1
    alone = NgramProposer(3, 2)
    alone.reset([1, 2, 3, 4, 5, 1, 2])
    assert both.propose(CHAIN, GREEDY).tokens == alone.propose(CHAIN, GREEDY).tokens == [3, 4, 5, 1]
    assert head.proposed == 1 and both.drafted_by == {"ngram": 1, "head": 1}
    assert head.seen == [1, 2, 3, 4, 5, 1, 2]  # the head saw every token, n-gram cycles included


@pytest.fixture(scope="module")
def tiny(one_thread):
    target = load_target(TargetConfig(name="tiny", dtype="float64"))
    return target, TargetRunner(target.model, 256, target.aux_layer_ids)


def _heads(target):
    V = target.vocab_size
    return {"eagle3": Eagle3Proposer(eagle3_head_f64(target), V, 256),
            "draft_model": DraftModelProposer(draft_llama(V, 1), V, 256),
            "peagle": PEagleProposer(peagle_head_f64(target), V, 256)}


@pytest.mark.parametrize("drafting", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["eagle3", "draft_model", "peagle"])
def test_greedy_is_token_identical_to_target_only(tiny, kind, drafting):
    target, runner = tiny
    both = NgramFirstProposer(NgramProposer(3, 2), _heads(target)[kind])
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.cat([repetitive_prompt(seed=seed), torch.randint(0, 256, (8,), generator=g)])
        ref = speculative_generate(runner, None, prompt, 40, GREEDY, DraftingConfig(), []).tokens
        assert speculative_generate(runner, both, prompt, 40, GREEDY, drafting, []).tokens == ref, (kind, seed)
    assert both.drafted_by["ngram"] > 0 and both.drafted_by["head"] > 0  # both paths ran


# ---- the head's state follows the sequence through n-gram cycles -------------------------------------------

def test_peagle_head_drafts_what_it_computes_from_scratch_after_ngram_cycles():
    V, k = 12, 4
    target = peaked_llama(V)
    head = peagle_decoder_head(target, [0, 1, 2, 4, 5, 7, 8, 10, 11])
    recording = PEagleRecordingProposer(head, V, 96)
    both = NgramFirstProposer(NgramProposer(2, 2), recording)
    speculative_generate(TargetRunner(target, 96, AUX), both, torch.tensor([3, 1, 4, 1, 5, 9, 2, 6]),
                         40, GREEDY, DraftingConfig("chain", k), [])
    assert both.drafted_by["ngram"] > 0 and len(recording.rounds) == both.drafted_by["head"] > 1
    for seq, logits in recording.rounds:  # pending features piled up over n-gram cycles ran in order
        torch.testing.assert_close(logits, peagle_from_scratch(head, target, seq, k), rtol=1e-9, atol=1e-9)


def test_eagle3_head_drafts_what_the_ttt_unroll_gives_after_ngram_cycles():
    target, k = eagle3_decoder_target(), EAGLE3_K
    head = eagle3_decoder_head(target)
    recording = Eagle3RecordingProposer(head, EAGLE3_V, 96)
    both = NgramFirstProposer(NgramProposer(2, 2), recording)
    speculative_generate(TargetRunner(target, 96, AUX), both, torch.tensor([3, 1, 4, 1, 5, 9, 2, 6]),
                         40, GREEDY, DraftingConfig("chain", k), [])
    assert both.drafted_by["ngram"] > 0 and len(recording.rounds) == both.drafted_by["head"] > 1
    for seq, draft, logits in recording.rounds:
        ids = seq + draft[:-1]
        with torch.no_grad():
            unrolled = list(ttt_unroll(head, torch.tensor([ids]), head.fuse(eagle3_decoder_features(target, ids)),
                                       torch.ones(1, len(ids), dtype=torch.long), k))
        for i in range(len(logits)):
            torch.testing.assert_close(logits[i], unrolled[i][0, len(seq) - 2], rtol=1e-9, atol=1e-9)


# ---- sampling: the distribution test of tests/test_decoder_sampling.py --------------------------------------

# (head, sampling, ngram_min): ngram_min chosen so that both sources draft often on this 8-token setup (P-EAGLE's
# accepted chains end most runs before a 2-gram match can recur)
SAMPLING_CASES = {
    "ngram+eagle3-T1": ("eagle3", SamplingConfig(temperature=1.0), 2),
    "ngram+draft_model-topk-topp": ("draft_model", SamplingConfig(temperature=0.8, top_k=5, top_p=0.9), 2),
    "ngram+peagle-T1": ("peagle", SamplingConfig(temperature=1.0), 1),
}


def _pvalue(case):
    kind, sampling, ngram_min = SAMPLING_CASES[case]
    target = sampling_llama(0, 60)
    runner = TargetRunner(target, 32, [0, 1, 1])
    both = NgramFirstProposer(NgramProposer(3, ngram_min), sampling_proposer(kind, target))
    counts, proposed = sampled_joint_and_proposed(runner, both, sampling, DraftingConfig("chain", 2))
    assert proposed[1] > 0  # chains of two were verified (four tokens generated: see _empirical)
    assert both.drafted_by["ngram"] > 100 and both.drafted_by["head"] > 100, both.drafted_by  # both drafted often
    return chi2_pvalue(counts, exact_joint(target, sampling))


@pytest.mark.slow  # 2500 seeded generations each
@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampling_matches_target_distribution(case):
    pval, stat, df = _pvalue(case)
    print(f"{case}: chi2={stat:.1f} df={df} p={pval:.3g}")
    assert pval > 1e-3, (case, stat, df)


@pytest.mark.slow
def test_negative_control_resampling_from_p_fails(monkeypatch):
    """A wrong sampler (on rejection, resample from p instead of the residual) must fail the same test."""
    monkeypatch.setattr(decoder, "residual_distribution", lambda p, q: p)
    pval, stat, df = _pvalue("ngram+eagle3-T1")
    print(f"wrong sampler ngram+eagle3-T1: chi2={stat:.1f} df={df} p={pval:.3g}")
    assert pval < 1e-4, (stat, df)


# ---- eval: ngram_first=true ---------------------------------------------------------------------------------

def test_eval_ngram_first_row(tmp_path):
    import json

    from draftsmith.configs import compose
    from draftsmith.eval.run import run

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, (c, t) in
                                 enumerate([("writing", "Say hi, say hi, say hi."), ("math", "What is 2+2?")])))
    head = save_tiny_head(tmp_path / "head")
    report = run(compose("eval", ["target=tiny", f"prompts.path={questions}", "prompts.n=null", "max_new_tokens=12",
                                  "repeats=1", "progress=false", "plot=false", f"out={tmp_path / 'out'}",
                                  f"head={head}", "ngram_first=true", "ngram_min=2", "baselines=[ngram]"]))
    assert report["method"] == "ngram+eagle3" and report["drafter"]["ngram_first"] is True
    assert report["greedy_identical_fraction"] == 1.0 and "ngram" in report["baselines"]


def test_ngram_first_needs_a_head_folder(compose_cfg):
    for head in ("ngram", "none"):
        with pytest.raises(DraftsmithError, match="ngram_first"):
            compose_cfg("eval", f"head={head}", "prompts.path=x.jsonl", "ngram_first=true")
