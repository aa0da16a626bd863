"""The EAGLE-3 proposer drafts, inside the decode loop, exactly what the TTT unroll trains.

Every draft round of `speculative_generate` with a real `Eagle3Proposer` is recorded (its committed
sequence, its draft and its logits at each depth), then the training-time-test unroll of
train/eagle3.py is run on the same sequence teacher-forced along the drafted tokens, with the
target's features from one plain HF forward: the logits must agree at every depth of every round, for a head
without and with the EAGLE-3.1 norms (norm_output: both hand the POST-norm hidden to the next step).
"""

import pytest
import torch
from helpers import (AUX, EAGLE3_K, EAGLE3_V, Eagle3RecordingProposer, eagle3_decoder_features, eagle3_decoder_head,
                     eagle3_decoder_target, ttt_unroll)

from draftsmith.eval.decoder import DraftingConfig, SamplingConfig, speculative_generate
from draftsmith.eval.proposers.eagle3 import Eagle3Proposer
from draftsmith.eval.target_runner import TargetRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# the EAGLE-3.1 norms: none, the post-norm hidden handed on alone, and all three
NORMS = {"plain": {}, "norm_output": {"norm_output": True},
         "all_norms": {"norm_before_fc": True, "fc_norm": True, "norm_output": True}}


@pytest.mark.parametrize("norms", list(NORMS))
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "T1"])
def test_proposer_logits_in_the_decode_loop_equal_the_ttt_unroll(sampling, norms):
    target, prompt = eagle3_decoder_target(), torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    head = eagle3_decoder_head(target, **NORMS[norms])
    proposer = Eagle3RecordingProposer(head, EAGLE3_V, 96)
    runner = TargetRunner(target, 96, AUX)
    g = torch.Generator().manual_seed(0)
    res = speculative_generate(runner, proposer, prompt, 40, sampling, DraftingConfig("chain", EAGLE3_K), [],
                               generator=g)
    assert len(res.tokens) == 40
    assert res.n_verifications - 1 <= len(proposer.rounds) <= res.n_verifications  # no draft when no room
    assert max(res.emitted_per_verification) > 1  # some rounds accepted drafts: their update() ran on several rows
    for seq, draft, logits in proposer.rounds:
        assert len(draft) == len(logits) == EAGLE3_K
        ids = seq + draft[:-1]  # teacher-forced along the drafted tokens
        t = len(seq) - 2  # the index whose step i drafts token len(seq) + i (the round's entry n-1)
        with torch.no_grad():
            unrolled = list(ttt_unroll(head, torch.tensor([ids]), head.fuse(eagle3_decoder_features(target, ids)),
                                       torch.ones(1, len(ids), dtype=torch.long), EAGLE3_K))
        for i in range(EAGLE3_K):
            torch.testing.assert_close(logits[i], unrolled[i][0, t], rtol=1e-9, atol=1e-9)


def test_draft_steps_attend_only_to_the_slots_in_use(monkeypatch):
    """A 4096-slot proposer cache costs what the sequence uses: no step attends past its last slot."""
    import torch.nn.functional as F

    widths, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        widths.append(k.shape[-2])
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    target, prompt = eagle3_decoder_target(), torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    proposer = Eagle3Proposer(eagle3_decoder_head(target), EAGLE3_V, 4096)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    res = speculative_generate(TargetRunner(target, 64, AUX), proposer, prompt, 20, SamplingConfig(),
                               DraftingConfig("tree", EAGLE3_K, 2, 6), [])
    assert len(res.tokens) == 20 and widths
    assert max(widths) <= len(prompt) + 20 + 6  # prompt + answer + one tree, never the 4096 slots
