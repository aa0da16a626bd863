"""The P-EAGLE proposer in the built-in decoder: one drafter forward per cycle drafts exactly what the drafter
computes from scratch on the committed sequence, greedy decoding is token-identical to target-only decoding,
and sampled decoding has the target's distribution (with the negative control failing)."""

import pytest
import torch
from method_checks import (SAMPLING_V, check_draft_forwards_attend_only_to_the_slots_in_use,
                           check_drafts_match_from_scratch, check_greedy_is_token_identical_to_target_only,
                           init_from_used_tokens, RecordsForwards, speculative_sampling_pvalue,
                           statistical_sampling_tests)
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.eval.decoder import SamplingConfig
from draftsmith.eval.proposers.peagle import PEagleProposer
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.heads.kit import causal_mask
from draftsmith.heads.peagle import PEagleHead, peagle_config_from_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

AUX = [0, 1, 2]  # HF hidden_states indices of a 2-layer target


def _target(V, seed=0, scale=8.0, layers=2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # peaked distributions
    return model


def _head(target, used: list[int], seed=4, layers=2, scale=1.0):
    torch.manual_seed(seed)
    V, Vd = target.config.vocab_size, len(used)
    head = PEagleHead(peagle_config_from_target(target.config, Vd, layers, mask_token_id=V - 1)).double().eval()
    init_from_used_tokens(head, target, used)
    with torch.no_grad():
        head.lm_head.weight.mul_(scale)
    return head


class RecordingProposer(RecordsForwards, PEagleProposer):
    """Keeps, per cycle: the committed sequence and the k rows of draft logits of the one forward."""


def _from_scratch(head, target, seq, k):
    """The drafter on the whole committed sequence, no cache: entries 0..L-2 (x_{p+1}, f_p), k-1 mask slots."""
    L = len(seq)
    with torch.no_grad():
        hs = target(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in AUX], dim=-1)  # (1, L-1, 3H): positions 0..L-2
        ids = torch.tensor([seq[1:] + [head.mask_token_id] * (k - 1)])
        hidden = torch.cat([head.fuse(aux), head.mask_fused()[None, None].expand(1, k - 1, -1)], dim=1)
        N = L - 1 + k - 1
        _, logits = head(ids, hidden, torch.arange(N)[None], causal_mask(N))
    return logits[0, L - 2:]


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "T1"])
def test_one_forward_per_cycle_drafts_what_the_drafter_computes_from_scratch(sampling):
    target = _target(12)
    head = _head(target, [0, 1, 2, 4, 5, 7, 8, 10, 11])
    res, _ = check_drafts_match_from_scratch(RecordingProposer, head, target, AUX, sampling, _from_scratch, 4)
    assert max(res.emitted_per_verification) > 1  # accepted drafts: cycles ran several new entries at once


def test_draft_forwards_attend_only_to_the_slots_in_use(monkeypatch):
    V = 12
    target = _target(V)
    proposer = PEagleProposer(_head(target, list(range(V))), V, 4096)
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
    target = _target(SAMPLING_V, seed=0, scale=60, layers=1)
    runner = TargetRunner(target, 32, [0, 1, 1])
    head = _head(target, [0, 1, 2, 4, 5, 7], seed=3, layers=2, scale=60)
    return speculative_sampling_pvalue(runner, PEagleProposer(head, SAMPLING_V, 32), target, sampling)


# the two seeded statistical tests (2500 generations each), shared with every one-forward proposer
test_sampling_matches_target_distribution, test_negative_control_resampling_from_p_fails = \
    statistical_sampling_tests(_sampled_pvalue)
