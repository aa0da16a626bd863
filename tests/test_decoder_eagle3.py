"""The EAGLE-3 proposer drafts, inside the decode loop, exactly what the TTT unroll trains.

Every draft round of `speculative_generate` with a real `Eagle3Proposer` is recorded (its committed
sequence, its draft and its logits at each depth), then the training-time-test unroll of
train/eagle3.py is run on the same sequence teacher-forced along the drafted tokens, with the
target's features from one plain HF forward: the logits must agree at every depth of every round, for a head
without and with the EAGLE-3.1 norms (norm_output: both hand the POST-norm hidden to the next step).
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.eval.decoder import DraftingConfig, SamplingConfig, speculative_generate
from draftsmith.eval.proposers.eagle3 import Eagle3Proposer
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
from draftsmith.train.eagle3 import ttt_unroll

V, VD = 12, 9  # target vocab, draft vocab: small, so that drafts are often accepted
AUX = [0, 1, 2]  # HF hidden_states indices of a 2-layer target (2 = after the final norm)
K = 4  # chain length

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peaked distributions
    return model


def _head(target, **norms):
    """`norms`: the EAGLE-3.1 norms it has (norm_before_fc=True, ...), their weights random so that they matter."""
    torch.manual_seed(4)  # a head whose greedy drafts are sometimes accepted
    head = Eagle3Head(eagle3_config_from_target(target.config, VD, **norms)).double().eval()
    used = torch.tensor([0, 1, 2, 4, 5, 7, 8, 10, 11])  # the draft vocab's target ids
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    head.init_from_target(target, used - torch.arange(VD), t2d)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith(("input_norm", "fc_norm")):
                p.uniform_(0.5, 1.5)
    return head


# the EAGLE-3.1 norms: none, the post-norm hidden handed on alone, and all three
NORMS = {"plain": {}, "norm_output": {"norm_output": True},
         "all_norms": {"norm_before_fc": True, "fc_norm": True, "norm_output": True}}


class RecordingProposer(Eagle3Proposer):
    """Keeps, per draft round: the committed sequence, the drafted target ids, the logits at each depth."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rounds = []

    def propose(self, drafting, sampling, generator=None):
        self._depth_logits = [self._root_logits.clone()]  # depth 1: entry n-1's output
        draft = super().propose(drafting, sampling, generator)
        assert self.n_entries == len(self.seq) - 1  # entry j consumed (h_j, x_{j+1})
        self.rounds.append((list(self.seq), draft.tokens, self._depth_logits))
        return draft

    def _expand(self, nodes, tokens, parents, depth):
        logits = super()._expand(nodes, tokens, parents, depth)  # (1, Vd): a chain has one node per depth
        self._depth_logits.append(logits[0].clone())
        return logits


def _features(target, ids: list[int]) -> torch.Tensor:
    """(1, T, 3H): the target's aux hidden states from one plain HF forward, no KV cache."""
    with torch.no_grad():
        hs = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in AUX], dim=-1)


@pytest.mark.parametrize("norms", list(NORMS))
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "T1"])
def test_proposer_logits_in_the_decode_loop_equal_the_ttt_unroll(sampling, norms):
    target, prompt = _target(), torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    head = _head(target, **NORMS[norms])
    proposer = RecordingProposer(head, V, 96)
    runner = TargetRunner(target, 96, AUX)
    g = torch.Generator().manual_seed(0)
    res = speculative_generate(runner, proposer, prompt, 40, sampling, DraftingConfig("chain", K), [], generator=g)
    assert len(res.tokens) == 40
    assert res.n_verifications - 1 <= len(proposer.rounds) <= res.n_verifications  # no draft when no room
    assert max(res.emitted_per_verification) > 1  # some rounds accepted drafts: their update() ran on several rows
    for seq, draft, logits in proposer.rounds:
        assert len(draft) == len(logits) == K
        ids = seq + draft[:-1]  # teacher-forced along the drafted tokens
        t = len(seq) - 2  # the index whose step i drafts token len(seq) + i (the round's entry n-1)
        with torch.no_grad():
            unrolled = list(ttt_unroll(head, torch.tensor([ids]), head.fuse(_features(target, ids)),
                                       torch.ones(1, len(ids), dtype=torch.long), K))
        for i in range(K):
            torch.testing.assert_close(logits[i], unrolled[i][0, t], rtol=1e-9, atol=1e-9)


def test_draft_steps_attend_only_to_the_slots_in_use(monkeypatch):
    """A 4096-slot proposer cache costs what the sequence uses: no step attends past its last slot."""
    import torch.nn.functional as F

    widths, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        widths.append(k.shape[-2])
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    target, prompt = _target(), torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    proposer = Eagle3Proposer(_head(target), V, 4096)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    res = speculative_generate(TargetRunner(target, 64, AUX), proposer, prompt, 20, SamplingConfig(),
                               DraftingConfig("tree", K, 2, 6), [])
    assert len(res.tokens) == 20 and widths
    assert max(widths) <= len(prompt) + 20 + 6  # prompt + answer + one tree, never the 4096 slots
