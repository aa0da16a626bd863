"""Distillation losses (train/losses.py) against values worked out by hand on small distributions."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.train import losses
from draftsmith.train.draft import parse_loss

P = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
Q = torch.tensor([[0.25, 0.75]], dtype=torch.float64)
ln = math.log

# by hand, p = (1/2, 1/2), q = (1/4, 3/4)
BY_HAND = {
    "fkl": 0.5 * ln(0.5 / 0.25) + 0.5 * ln(0.5 / 0.75),  # = 1/2 ln(4/3)
    "rkl": 0.25 * ln(0.25 / 0.5) + 0.75 * ln(0.75 / 0.5),
    "tv": 0.5 * (abs(0.5 - 0.25) + abs(0.5 - 0.75)),  # = 1/4
    # m = (3/8, 5/8)
    "jsd": 0.5 * (0.5 * ln(0.5 / 0.375) + 0.5 * ln(0.5 / 0.625)) + 0.5 * (0.25 * ln(0.25 / 0.375) + 0.75 * ln(0.75 / 0.625)),
}


@pytest.mark.parametrize("name", sorted(BY_HAND))
def test_each_divergence_matches_hand_values(name):
    total, terms = losses.mix({name: 1.0}, P.log(), Q.log(), Q.log()[:, 1])
    assert terms[name].item() == pytest.approx(BY_HAND[name], rel=1e-12)
    assert total.item() == pytest.approx(BY_HAND[name], rel=1e-12)


def test_jsd_beta_and_ce_and_mix():
    beta = 0.2  # m = 0.2 p + 0.8 q = (0.3, 0.7)
    want = beta * (0.5 * ln(0.5 / 0.3) + 0.5 * ln(0.5 / 0.7)) + (1 - beta) * (0.25 * ln(0.25 / 0.3) + 0.75 * ln(0.75 / 0.7))
    assert losses.jsd(P.log(), Q.log(), beta).item() == pytest.approx(want, rel=1e-12)
    # CE = -log q_x, x = the target's sampled token (here token 1: log q_x = ln 0.75)
    assert losses.mix({"ce": 1.0}, P.log(), Q.log(), Q.log()[:, 1])[1]["ce"].item() == pytest.approx(-ln(0.75), rel=1e-12)
    total, _ = losses.mix(parse_loss("0.7*fkl+0.3*ce"), P.log(), Q.log(), Q.log()[:, 1])
    assert total.item() == pytest.approx(0.7 * BY_HAND["fkl"] - 0.3 * ln(0.75), rel=1e-12)
    assert losses.acceptance(P.log(), Q.log()).item() == pytest.approx(0.75)  # = 1 - TV


def test_zero_probabilities_count_zero():
    p = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    assert losses.forward_kl(p.log(), q.log()).item() == pytest.approx(ln(2))
    assert losses.total_variation(p.log(), q.log()).item() == pytest.approx(0.5)
    assert math.isinf(losses.reverse_kl(p.log(), q.log()).item())  # q puts mass where p has none


@pytest.mark.parametrize("name", losses.LOSSES[:4])
def test_exactly_zero_when_draft_equals_target(name):
    logits = torch.randn(5, 11, dtype=torch.float64) * 3
    logp = torch.log_softmax(logits, -1)
    value = losses.mix({name: 1.0}, logp, logp.clone(), logp[:, 0])[1][name]
    assert torch.equal(value, torch.zeros(5, dtype=torch.float64))


@pytest.mark.parametrize("name", losses.LOSSES)
def test_gradient_moves_q_towards_p(name):
    """q = softmax(z) = (1/4, 3/4), p = (1/2, 1/2): every loss must push z_0 up (the sampled token is 0)."""
    z = Q.log().clone().requires_grad_(True)
    logq = torch.log_softmax(z, -1)
    total, _ = losses.mix({name: 1.0}, P.log(), logq, logq[:, 0])
    total.sum().backward()
    assert z.grad[0, 0] < 0 < z.grad[0, 1]
    if name == "fkl":  # d KL(p || softmax z) / dz = q - p
        torch.testing.assert_close(z.grad, Q - P)


@pytest.mark.parametrize("name", losses.LOSSES[:4])
def test_topk_with_k_equal_to_vocab_is_the_full_loss(name):
    torch.manual_seed(0)
    V = 9
    target_logits, draft_logits = torch.randn(6, V) * 2, (torch.randn(6, V) * 2).requires_grad_(True)
    logp = torch.log_softmax(target_logits, -1)
    full = losses.mix({name: 1.0}, logp, torch.log_softmax(draft_logits, -1), logp[:, 0])[0]
    g_full, = torch.autograd.grad(full.sum(), draft_logits)
    top, ids = logp.topk(V, -1)
    tail = torch.logsumexp(logp.scatter(-1, ids, float("-inf")), -1)  # what data_gen/topk.py stores: -inf here
    assert torch.isinf(tail).all()
    cached = losses.mix({name: 1.0}, losses.with_tail(top, tail), losses.draft_on_topk(draft_logits, ids), logp[:, 0])[0]
    g_cached, = torch.autograd.grad(cached.sum(), draft_logits)
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_cached, g_full, rtol=1e-5, atol=1e-6)
    # a smaller k merges the rest into one outcome: never more than the full divergence
    top, ids = logp.topk(3, -1)
    tail = torch.logsumexp(logp.scatter(-1, ids, float("-inf")), -1)
    cut = losses.mix({name: 1.0}, losses.with_tail(top, tail), losses.draft_on_topk(draft_logits, ids), logp[:, 0])[0]
    assert (cut <= full + 1e-6).all()


def test_loss_spec_refusals():
    from draftsmith.core import DraftsmithError

    assert parse_loss("jsd") == {"jsd": 1.0}
    assert parse_loss("0.5*fkl + 0.5*rkl") == {"fkl": 0.5, "rkl": 0.5}
    for bad in ("kl", "fkl+fkl", "0*fkl", "2*", ""):
        with pytest.raises(DraftsmithError, match="method.loss="):
            parse_loss(bad)
