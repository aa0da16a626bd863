"""Distillation losses between the target's distribution p and the draft's q, per position.

Every divergence takes log-probabilities `logp` (target) and `logq` (draft) of shape (N, V) over the
same V outcomes (the full vocab, or a top-k cache's k tokens plus one "tail" outcome holding the
rest of the mass) and returns (N,). Terms with zero probability count 0 (0 * log 0 = 0), so every
divergence is exactly 0 when q == p. Temperature is applied to the logits before they get here
(`log_softmax(logits / T)`), to both sides alike.

    fkl   forward KL     KL(p || q) = sum_v p_v (log p_v - log q_v)           mean-seeking
    rkl   reverse KL     KL(q || p) = sum_v q_v (log q_v - log p_v)           mode-seeking
    jsd   JSD(beta)      beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q
    tv    total variation  1/2 sum_v |p_v - q_v|  (= 1 - sum_v min(p_v, q_v): one minus the acceptance rate)
    ce    cross-entropy on the target's sampled token x:  -log q_x

`ce` needs the sampled tokens (the data's next tokens) instead of p; `mix` weighs any of them.
"""

from __future__ import annotations

import torch

LOSSES = ("fkl", "rkl", "jsd", "tv", "ce")


def _plogratio(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """p * (log p - log q) elementwise, 0 where p == 0."""
    p = logp.exp()
    keep = p > 0  # where p == 0 use finite stand-ins, so no inf * 0 reaches forward or backward
    zero = torch.zeros_like(p)
    return p * (torch.where(keep, logp, zero) - torch.where(keep, logq, zero))


def forward_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    # KL(p || q) = sum_v p_v (log p_v - log q_v)
    return _plogratio(logp, logq).sum(-1)


def reverse_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    # KL(q || p) = sum_v q_v (log q_v - log p_v)
    return _plogratio(logq, logp).sum(-1)


def jsd(logp: torch.Tensor, logq: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    # JSD_beta = beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q  (GKD's convention)
    if beta <= 0 or beta >= 1:  # m == q or m == p: the divergence is 0 by this definition
        return torch.zeros(logp.shape[:-1], dtype=logp.dtype, device=logp.device)
    # log m relative to the larger side (log1p / expm1 of a non-positive gap): exactly log p when q == p
    p_big = logp >= logq
    logm = torch.where(p_big, logp + torch.log1p((1 - beta) * torch.expm1(logq - logp)),
                       logq + torch.log1p(beta * torch.expm1(logp - logq)))
    return beta * _plogratio(logp, logm).sum(-1) + (1 - beta) * _plogratio(logq, logm).sum(-1)


def total_variation(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    # TV(p, q) = 1/2 sum_v |p_v - q_v|
    return 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)


DIVERGENCES = {"fkl": forward_kl, "rkl": reverse_kl, "tv": total_variation}


def mix(weights: dict[str, float], logp: torch.Tensor, logq: torch.Tensor, sampled_logq: torch.Tensor,
        beta: float = 0.5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum_name weight * loss_name per position: ((N,) total, {name: (N,)} each term unweighted).

    `sampled_logq` (N,) is log q of the target's sampled token (the `ce` term is its negative)."""
    terms = {}
    for name in weights:
        if name == "ce":
            terms[name] = -sampled_logq
        elif name == "jsd":
            terms[name] = jsd(logp, logq, beta)
        else:
            terms[name] = DIVERGENCES[name](logp, logq)
    total = sum(w * terms[name] for name, w in weights.items())
    assert isinstance(total, torch.Tensor), "no loss term weighted"  # (sum's 0 for none)
    return total, terms


def acceptance(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Expected acceptance of one drafted token, alpha = sum_v min(p_v, q_v) (N,)."""
    return torch.minimum(logp.exp(), logq.exp()).sum(-1)


def with_tail(logp_topk: torch.Tensor, tail_logp: torch.Tensor) -> torch.Tensor:
    """(N, k) top-k log-probs + (N,) log of the rest's mass -> (N, k + 1) log-probs over k tokens and the tail."""
    return torch.cat([logp_topk, tail_logp[:, None]], dim=-1)


def draft_on_topk(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The draft's log-probs (N, k + 1) over a top-k cache's tokens `ids` (N, k) and the tail (every other token).

    The tail is log-sum-exp over the other tokens directly (not log(1 - sum)), so it is exactly
    -inf when k equals the vocab."""
    logq = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, V)
    top = logq.gather(-1, ids)  # (N, k)
    if ids.shape[-1] >= logq.shape[-1]:  # nothing is left out: the tail has no mass (and no gradient)
        return with_tail(top, torch.full_like(top[:, 0], float("-inf")).detach())
    rest = logq.scatter(-1, ids, float("-inf"))
    return with_tail(top, torch.logsumexp(rest, dim=-1))
