"""The TTT unroll equals the drafter run autoregressively, and the loss behaves."""

from __future__ import annotations

import pytest
import torch
from helpers import causal_mask, ttt_unroll

from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
from draftsmith.heads.kit import StaticKVCache
from draftsmith.heads.vocab import build_vocab_map
from draftsmith.train.eagle3 import eagle3_loss
from draftsmith.train.features import TargetHead


def _setup(steps=4, T=11, B=2, draft_vocab=200, **norms):
    torch.manual_seed(0)
    target = load_target(TargetConfig(name="tiny", dtype="float64"))
    head = Eagle3Head(eagle3_config_from_target(target.model.config, draft_vocab, **norms)).double()
    counts = torch.randint(0, 100, (target.vocab_size,))
    d2t, t2d = build_vocab_map(counts, draft_vocab)
    head.init_from_target(target.model, d2t, t2d)
    input_ids = torch.randint(0, target.vocab_size, (B, T))
    attention_mask = torch.ones(B, T, dtype=torch.long)
    attention_mask[1, T - 3:] = 0  # right padding in the second row
    aux, last = target.features(input_ids, attention_mask)
    return target, head, input_ids, attention_mask, aux, last


def reference_logits(head, input_ids, fused, b, t, steps):
    """Draft autoregressively from index t of row b: step 0 over the prefix, then steps 1.. one token each."""
    S = t + steps  # slots 0..t for step 0, then t+1.. for steps 1..
    cache = StaticKVCache(1, S, head.config.num_key_value_heads, head.config.head_dim, dtype=torch.float64)
    tokens = input_ids[b:b + 1, 1:t + 2]  # x_1 .. x_{t+1}
    pos = torch.arange(t + 1)[None]
    mask = torch.zeros(1, 1, t + 1, S, dtype=torch.bool)
    mask[..., :t + 1] = causal_mask(t + 1)
    h, logits = head(tokens, fused[b:b + 1, :t + 1], pos, mask, cache, torch.arange(t + 1))
    out = [logits[0, t]]
    h = h[:, t:t + 1]
    for j in range(1, steps):
        p = t + j
        mask = torch.zeros(1, 1, 1, S, dtype=torch.bool)
        mask[..., :p + 1] = True
        h, logits = head(input_ids[b:b + 1, p + 1:p + 2], h, torch.tensor([[p]]), mask, cache, torch.tensor([p]))
        out.append(logits[0, 0])
    return out


@pytest.mark.parametrize("norms", [{}, {"norm_output": True}, {"norm_before_fc": True, "fc_norm": True,
                                                                 "norm_output": True}], ids=["plain", "norm_output", "all_norms"])
def test_unroll_matches_autoregressive_drafting(norms):
    steps = 4
    _, head, input_ids, attention_mask, aux, _ = _setup(steps, **norms)
    fused = head.fuse(aux)
    with torch.no_grad():
        unrolled = list(ttt_unroll(head, input_ids, fused, attention_mask, steps))
        for b in range(input_ids.shape[0]):
            real = int(attention_mask[b].sum())
            for t in range(real - 1):
                n = min(steps, real - 1 - t)  # steps whose input token x_{t+1+i} is inside the sequence
                ref = reference_logits(head, input_ids, fused, b, t, n)
                for i in range(n):
                    torch.testing.assert_close(unrolled[i][b, t], ref[i], rtol=1e-9, atol=1e-9)


def test_loss_masks_and_metrics():
    target, head, input_ids, attention_mask, aux, last = _setup()
    loss_mask = torch.ones_like(input_ids)
    tgt = TargetHead(target.model.lm_head.weight, head.t2d)(last)
    assert torch.allclose(tgt.probs.sum(-1), torch.ones(()).double().float())
    full = torch.softmax(target.logits(last).float(), -1)
    assert torch.equal(tgt.argmax, full.argmax(-1))
    torch.testing.assert_close(tgt.in_mass, full[..., head.t2d].sum(-1))
    loss, stats = eagle3_loss(head, input_ids, attention_mask, loss_mask, aux, tgt, steps=3)
    assert loss.requires_grad and torch.isfinite(loss)
    loss.backward()
    assert head.fc.weight.grad is not None and head.embed_tokens.weight.grad is None
    # step i scores indices t with t+1+i inside the real sequence
    real = attention_mask.sum(1)
    for i in range(3):
        assert stats[i, 4].item() == sum(max(int(r) - 1 - i, 0) for r in real)
    # nothing masked in -> zero loss, no NaN
    zero, stats0 = eagle3_loss(head, input_ids, attention_mask, torch.zeros_like(loss_mask), aux, tgt, steps=2)
    assert zero.item() == 0.0 and stats0[:, 1].sum() == 0
