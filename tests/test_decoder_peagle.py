"""The P-EAGLE proposer in the built-in decoder: one drafter forward per cycle drafts exactly what the drafter
computes from scratch on the committed sequence, greedy decoding is token-identical to target-only decoding,
and sampled decoding has the target's distribution (with the negative control failing)."""

import pytest
import torch
from helpers import (AUX, PEagleRecordingProposer, SAMPLING_V, check_draft_forwards_attend_only_to_the_slots_in_use,
                     check_drafts_match_from_scratch, check_greedy_is_token_identical_to_target_only,
                     init_from_used_tokens, peagle_decoder_head, peagle_from_scratch, peaked_llama,
                     speculative_sampling_pvalue, statistical_sampling_tests)

from draftsmith.eval.decoder import SamplingConfig
from draftsmith.eval.proposers.peagle import PEagleProposer
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.heads.peagle import PEagleHead, peagle_config_from_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "T1"])
def test_one_forward_per_cycle_drafts_what_the_drafter_computes_from_scratch(sampling):
    target = peaked_llama(12)
    head = peagle_decoder_head(target, [0, 1, 2, 4, 5, 7, 8, 10, 11])
    res, _ = check_drafts_match_from_scratch(PEagleRecordingProposer, head, target, AUX, sampling, peagle_from_scratch,
                                             4)
    assert max(res.emitted_per_verification) > 1  # accepted drafts: cycles ran several new entries at once


def test_draft_forwards_attend_only_to_the_slots_in_use(monkeypatch):
    V = 12
    target = peaked_llama(V)
    proposer = PEagleProposer(peagle_decoder_head(target, list(range(V))), V, 4096)
    check_draft_forwards_attend_only_to_the_slots_in_use(monkeypatch, proposer, target, AUX, extra_slots=0)


# ---- lossless: greedy token-identical, sampling distribution-exact ----------------------------------------

@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_is_token_identical_to_target_only(k):
    from draftsmith.data_gen.target import TargetConfig, load_target

    tiny = load_target(TargetConfig(name="tiny", dtype="float64"))
    torch.manual_seed(0)
    head = PEagleHead(peagle_config_from_target(tiny.model.config, 200, 2, tiny.vocab_size - 1)).double().eval()
    init_from_used_tokens(head, tiny.model, torch.sort(torch.randperm(tiny.vocab_size)[:200]).values)
    check_greedy_is_token_identical_to_target_only(tiny, PEagleProposer(head, tiny.vocab_size, 256), k)


def _sampled_pvalue(sampling):
    target = peaked_llama(SAMPLING_V, seed=0, scale=60, layers=1)
    runner = TargetRunner(target, 32, [0, 1, 1])
    head = peagle_decoder_head(target, [0, 1, 2, 4, 5, 7], seed=3, layers=2, scale=60)
    return speculative_sampling_pvalue(runner, PEagleProposer(head, SAMPLING_V, 32), target, sampling)


# the two seeded statistical tests (2500 generations each), shared with every one-forward proposer
test_sampling_matches_target_distribution, test_negative_control_resampling_from_p_fails = \
    statistical_sampling_tests(_sampled_pvalue)
