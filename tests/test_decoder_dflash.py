"""The DFlash proposer in the built-in decoder: one drafter forward per cycle drafts exactly what the drafter
computes from scratch on the committed sequence, greedy decoding is token-identical to target-only decoding,
`stop_below` only shortens the chain, and sampled decoding has the target's distribution (with the negative
control failing)."""

import pytest
import torch
from helpers import (RecordsForwards, SAMPLING_V, check_draft_forwards_attend_only_to_the_slots_in_use,
                     check_drafts_match_from_scratch, check_greedy_is_token_identical_to_target_only,
                     init_from_used_tokens, peaked_llama, randomize_weights, speculative_sampling_pvalue,
                     statistical_sampling_tests)

from draftsmith.eval.decoder import DraftingConfig, SamplingConfig, speculative_generate
from draftsmith.eval.proposers.dflash import DFlashProposer
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.heads.dflash import DFlashHead, dflash_config_from_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

AUX = [0, 1, 2]  # HF hidden_states indices of a 2-layer target


def _head(target, used: list[int], seed=4, layers=2, scale=1.0, block_size=8, aux=AUX):
    torch.manual_seed(seed)
    V, Vd = target.config.vocab_size, len(used)
    head = DFlashHead(dflash_config_from_target(target.config, Vd, layers, block_size, V - 1, aux)).double().eval()
    init_from_used_tokens(head, target, used)
    randomize_weights(head, ("fc", "layers", "hidden_norm"))  # random everywhere, so a wrong wiring shows
    with torch.no_grad():
        head.lm_head.weight.mul_(scale)
    return head


class RecordingProposer(RecordsForwards, DFlashProposer):
    """Keeps, per cycle: the committed sequence and the k rows of draft logits of the one forward."""


def _from_scratch(head, target, seq, k):
    """The drafter on the whole committed sequence, no cache: context f_0 .. f_{L-2}, the block [x_{L-1}, k masks]
    at positions L-1 .. L-1+k, every query seeing every key."""
    L = len(seq)
    with torch.no_grad():
        hs = target(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in AUX], dim=-1)  # (1, L-1, 3H): positions 0..L-2
        ids = torch.tensor([[seq[-1]] + [head.mask_token_id] * k])
        mask = torch.ones(1, 1, k + 1, L - 1 + k + 1, dtype=torch.bool)
        _, logits = head(ids, torch.arange(L - 1, L + k)[None], head.context(aux), torch.arange(L - 1)[None], mask)
    return logits[0, 1:]


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "T1"])
def test_one_forward_per_cycle_drafts_what_the_drafter_computes_from_scratch(sampling):
    target = peaked_llama(12)
    head = _head(target, [0, 1, 2, 4, 5, 7, 8, 10, 11])
    _, proposer = check_drafts_match_from_scratch(RecordingProposer, head, target, AUX, sampling, _from_scratch, 4)
    assert len(proposer.rounds) > 3


def test_draft_forwards_attend_only_to_the_slots_in_use(monkeypatch):
    V = 12
    target = peaked_llama(V)
    proposer = DFlashProposer(_head(target, list(range(V))), V, 4096)
    check_draft_forwards_attend_only_to_the_slots_in_use(monkeypatch, proposer, target, AUX, extra_slots=1)


def test_stop_below_shortens_the_chain_only():
    V, K = 12, 5
    target = peaked_llama(V)
    head = _head(target, list(range(V)), scale=0.2)  # flat drafts: most probabilities are low
    prompt = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    runner = TargetRunner(target, 96, AUX)
    fixed = speculative_generate(runner, DFlashProposer(head, V, 96), prompt, 30, SamplingConfig(),
                                 DraftingConfig("chain", K), [])
    dynamic = speculative_generate(runner, DFlashProposer(head, V, 96), prompt, 30, SamplingConfig(),
                                   DraftingConfig("chain", K, stop_below=0.3), [])
    assert dynamic.tokens == fixed.tokens  # lossless either way

    def sizes_far_from_the_end(res):  # the decoder shortens a draft that would run past max_new_tokens
        done = 1 + torch.tensor([0] + res.emitted_per_verification).cumsum(0)[:-1]  # tokens emitted before each
        return [n for n, d in zip(res.draft_sizes, done.tolist()) if 30 - d > K + 1]

    assert set(sizes_far_from_the_end(fixed)) == {K}
    assert min(sizes_far_from_the_end(dynamic)) < K  # some chains were cut by stop_below


def test_more_tokens_than_a_trained_block_is_refused():
    from draftsmith.core import DraftsmithError

    V = 12
    target = peaked_llama(V)
    proposer = DFlashProposer(_head(target, list(range(V)), block_size=4), V, 96)
    with pytest.raises(DraftsmithError, match=r"K=4 .* more than the 3 tokens a block of this DFlash head drafts"):
        speculative_generate(TargetRunner(target, 96, AUX), proposer, torch.tensor([3, 1, 4]), 8, SamplingConfig(),
                             DraftingConfig("chain", 4), [])


# ---- lossless: greedy token-identical, sampling distribution-exact ----------------------------------------

@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_is_token_identical_to_target_only(k):
    from draftsmith.data_gen.target import TargetConfig, load_target

    tiny = load_target(TargetConfig(name="tiny", dtype="float64"))
    torch.manual_seed(0)
    used = torch.sort(torch.randperm(tiny.vocab_size)[:200]).values.tolist()
    head = _head(tiny.model, used, aux=tiny.aux_layer_ids)
    check_greedy_is_token_identical_to_target_only(tiny, DFlashProposer(head, tiny.vocab_size, 256), k)


def _sampled_pvalue(sampling):
    target = peaked_llama(SAMPLING_V, seed=0, scale=60, layers=1)
    runner = TargetRunner(target, 32, [0, 1, 1])
    head = _head(target, [0, 1, 2, 4, 5, 7], seed=3, layers=2, scale=60, aux=[0, 1, 1])
    return speculative_sampling_pvalue(runner, DFlashProposer(head, SAMPLING_V, 32), target, sampling)


# the two seeded statistical tests (2500 generations each), shared with every one-forward proposer
test_sampling_matches_target_distribution, test_negative_control_resampling_from_p_fails = \
    statistical_sampling_tests(_sampled_pvalue)
