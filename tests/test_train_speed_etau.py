"""The expected acceptance length E[tau] that training logs from its TTT unroll (no decoding) agrees with the
tau the built-in decoder measures, for a head overfit to a tiny target.

The data is the target's own continuations (greedy for the greedy check, sampled at temperature 1 for the
sampling one), the loss mask covers the continuation, and the decoder drafts chains of the TTT depth K from
the same prompts. Greedy: per anchor, the estimate counts the leading drafts equal to the target's argmax,
which is what a verification from that anchor emits; the decoder only visits some anchors, so the two are
means over different anchors and agree within 0.25 tokens. Sampling: alpha_i is the acceptance probability
of a draft given the data's (target-sampled) prefix; the tolerance is wider, 0.4 tokens, since accepted tokens
follow min(p, q), not p.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.eval.decoder import DraftingConfig, SamplingConfig, speculative_generate
from draftsmith.eval.proposers.eagle3 import Eagle3Proposer
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
from draftsmith.train.eagle3 import eagle3_loss, summarize
from draftsmith.train.features import TargetHead

V = 16  # target vocab = draft vocab: no target token falls outside
AUX = [0, 1, 2]  # HF hidden_states indices of a 2-layer target
K = 3  # TTT depth = chain length
P, N = 6, 48  # prompt tokens, generated tokens

pytestmark = pytest.mark.usefixtures("one_thread")


def _target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6)  # peaked distributions: a head can learn them
    return model


def _continuations(target, prompts, sampling: SamplingConfig, seed: int) -> list[list[int]]:
    """prompt + the target's own N tokens (target-only decoding through the decoder)."""
    g = torch.Generator().manual_seed(seed)
    return [p.tolist() + speculative_generate(TargetRunner(target, P + N + 8, AUX), None, p, N, sampling,
                                              DraftingConfig("chain", K), [], generator=g).tokens for p in prompts]


def _batch(target, rows: list[list[int]]):
    ids = torch.tensor(rows)
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i] for i in AUX], dim=-1)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, P:] = 1  # targets of the continuation only (what the decoder drafts)
    return ids, torch.ones_like(ids), loss_mask, aux, hs[-1]


def _train_head(target, rows, steps: int):
    torch.manual_seed(1)
    head = Eagle3Head(eagle3_config_from_target(target.config, V)).double()
    head.init_from_target(target, torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    ids, am, lm, aux, last = _batch(target, rows)
    tgt = TargetHead(target.lm_head.weight, head.t2d)(last)
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss, _ = eagle3_loss(head, ids, am, lm, aux, tgt, steps=K)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return head.eval()


def _estimate(head, target, rows) -> dict:
    ids, am, lm, aux, last = _batch(target, rows)
    with torch.no_grad():
        _, stats = eagle3_loss(head, ids, am, lm, aux, TargetHead(target.lm_head.weight, head.t2d)(last), steps=K)
    return summarize(stats)


def _measured_tau(head, target, prompts, sampling: SamplingConfig) -> float:
    g = torch.Generator().manual_seed(7)
    emitted = verifications = 0
    for p in prompts:
        res = speculative_generate(TargetRunner(target, P + N + 8, AUX), Eagle3Proposer(head, V, P + N + 8), p, N,
                                   sampling, DraftingConfig("chain", K), [], generator=g)
        emitted, verifications = emitted + sum(res.emitted_per_verification), verifications + res.n_verifications
    return emitted / verifications


@pytest.mark.slow  # seeded decodes against the estimate
@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_etau_estimate_matches_decoder_tau(mode):
    target = _target()
    sampling = SamplingConfig() if mode == "greedy" else SamplingConfig(temperature=1.0)
    gen = torch.Generator().manual_seed(3)
    train_prompts = [torch.randint(0, V, (P,), generator=gen) for _ in range(24)]
    held_out = [torch.randint(0, V, (P,), generator=gen) for _ in range(12)]
    head = _train_head(target, _continuations(target, train_prompts, sampling, seed=1), steps=150)
    estimate = _estimate(head, target, _continuations(target, held_out, sampling, seed=2))[f"etau_{mode}"]
    measured = _measured_tau(head, target, held_out, sampling)
    print(f"{mode}: E[tau] estimate {estimate:.3f}, decoder tau {measured:.3f}")
    assert 1.3 < measured < K + 0.8  # a head that is neither useless nor perfect: the check can fail
    assert abs(estimate - measured) < (0.25 if mode == "greedy" else 0.4)
