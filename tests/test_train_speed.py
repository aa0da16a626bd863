"""The fast EAGLE-3 step (one causal block + per-index scores, only the rows that count, one fused soft-CE)
equals the straightforward one it replaced, in float64: logits, loss, gradients and statistics (with and without
the EAGLE-3.1 norms: the reference is the head's own forward, which hands each step's hidden on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import ttt_mask, ttt_unroll
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
from draftsmith.heads.kit import ConcatKVCache
from draftsmith.heads.vocab import build_vocab_map
from draftsmith.train.eagle3 import STATS, SoftCE, eagle3_loss, summarize, ttt_spans
from draftsmith.train.features import TargetHead


def reference_unroll(head, input_ids, hidden, attention_mask, steps):
    """The unroll as it was: the head's own forward with a dense (T, (i+1)T) mask over a ConcatKVCache."""
    B, T = input_ids.shape
    cache = ConcatKVCache()
    positions = torch.arange(T)[None].expand(B, T)
    key_ok = attention_mask.bool()[:, None, None, :]
    for i in range(steps):
        tokens = F.pad(input_ids[:, 1 + i:], (0, 1 + i))
        later_keys = torch.ones(B, 1, 1, i * T, dtype=torch.bool)
        mask = ttt_mask(T, i) & torch.cat([key_ok, later_keys], dim=-1)
        hidden, logits = head(tokens, hidden, positions + i, mask, cache)
        yield logits


def reference_loss(head, input_ids, attention_mask, loss_mask, aux, target, steps, decay=0.8):
    """The loss as it was: every index through the lm_head, cross_entropy, then softmax again for alpha."""
    B, T = input_ids.shape
    valid = loss_mask.bool() & attention_mask.bool()
    loss = 0.0
    stats = []
    for i, logits in enumerate(reference_unroll(head, input_ids, head.fuse(aux), attention_mask, steps)):
        k = 1 + i
        n = max(T - k, 0)
        q_logits = logits[:, :n]
        p = target.probs[:, k:]
        m_metric = valid[:, k:]
        m_loss = m_metric & target.argmax_in_draft[:, k:]
        ce = F.cross_entropy(q_logits.reshape(-1, q_logits.shape[-1]), p.reshape(-1, p.shape[-1]),
                             reduction="none").view(B, n)
        n_loss = m_loss.sum()
        loss_i = (ce * m_loss).sum() / n_loss.clamp(min=1)
        loss = loss + decay ** i * loss_i
        with torch.no_grad():
            q = torch.softmax(q_logits, dim=-1)
            correct = (head.draft_to_target(q_logits.argmax(dim=-1)) == target.argmax[:, k:]) & m_metric
            alpha = torch.minimum(q, p * target.in_mass[:, k:, None]).sum(-1)
            stats.append([(loss_i * n_loss).item(), n_loss.item(), correct.sum().item(), (alpha * m_metric).sum().item(),
                          m_metric.sum().item()])
    return loss, torch.tensor(stats, dtype=torch.float64)


@pytest.fixture(autouse=True)
def float64_rms_norms(monkeypatch):
    """transformers' LlamaRMSNorm computes in float32 whatever its input: in float64 here, so that the two unrolls
    (which norm the same rows as slices of different tensors once norm_output hands on the final norm) agree to
    float64 rounding, not float32's."""
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)


# the EAGLE-3.1 norms: none, or all three (input_norm and fc_norm before fc, the post-norm hidden handed on)
NORMS = {"plain": {}, "all_norms": {"norm_before_fc": True, "fc_norm": True, "norm_output": True}}


def _setup(T=13, B=2, draft_vocab=150, norms="plain"):
    torch.manual_seed(0)
    target = load_target(TargetConfig(name="tiny", dtype="float64"))
    head = Eagle3Head(eagle3_config_from_target(target.model.config, draft_vocab, **NORMS[norms])).double()
    d2t, t2d = build_vocab_map(torch.randint(0, 100, (target.vocab_size,)), draft_vocab)
    head.init_from_target(target.model, d2t, t2d)
    with torch.no_grad():  # a trained-looking head: random weights everywhere, not the init's zeros / ones
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    input_ids = torch.randint(0, target.vocab_size, (B, T))
    attention_mask = torch.ones(B, T, dtype=torch.long)
    attention_mask[1, T - 4:] = 0
    loss_mask = torch.ones(B, T, dtype=torch.long)
    loss_mask[0, :3] = 0
    aux, last = target.features(input_ids, attention_mask)
    tgt = TargetHead(target.model.lm_head.weight, head.t2d)(last)
    tgt.probs, tgt.in_mass = tgt.probs.double(), tgt.in_mass.double()
    return head, input_ids, attention_mask, loss_mask, aux, tgt


@pytest.mark.parametrize("norms", list(NORMS))
def test_unroll_equals_dense_mask_unroll(norms):
    head, input_ids, attention_mask, _, aux, _ = _setup(norms=norms)
    with torch.no_grad():
        fused = head.fuse(aux)
        fast = list(ttt_unroll(head, input_ids, fused, attention_mask, 5))
        ref = list(reference_unroll(head, input_ids, fused, attention_mask, 5))
    real = attention_mask.bool()
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a[real], b[real], rtol=1e-10, atol=1e-10)  # padding indices are never read


@pytest.mark.parametrize("norms", list(NORMS))
@pytest.mark.parametrize("steps", [1, 4, 12])  # 12 = T - 1: the last steps have (almost) no index left to score
def test_loss_gradients_and_stats_equal_reference(steps, norms):
    head, input_ids, attention_mask, loss_mask, aux, tgt = _setup(norms=norms)
    assert not bool(tgt.argmax_in_draft.all())  # some targets fall outside the draft vocab: masked out of the loss
    stats = _assert_step_equals_reference(head, input_ids, attention_mask, loss_mask, aux, tgt, steps)
    outside = STATS.index("outside_draft")
    assert stats[0, outside] > 0


def _assert_step_equals_reference(head, input_ids, attention_mask, loss_mask, aux, tgt, steps) -> torch.Tensor:
    """eagle3_loss's loss, gradients and statistics equal reference_loss's (a parameter without a gradient in
    one has a zero one in the other); returns the statistics."""
    loss, stats = eagle3_loss(head, input_ids, attention_mask, loss_mask, aux, tgt, steps=steps)
    loss.backward()
    fast_grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    head.zero_grad(set_to_none=True)
    ref_loss, ref_stats = reference_loss(head, input_ids, attention_mask, loss_mask, aux, tgt, steps)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    for n, p in head.named_parameters():
        if p.grad is not None and n in fast_grads:
            torch.testing.assert_close(fast_grads[n], p.grad, rtol=1e-8, atol=1e-10, msg=n)
        elif p.grad is not None or n in fast_grads:
            assert not (p.grad if p.grad is not None else fast_grads[n]).any(), n
    torch.testing.assert_close(stats[:, :5].double(), ref_stats, rtol=1e-5, atol=1e-5)
    return stats


@pytest.mark.parametrize("norms", list(NORMS))
@pytest.mark.parametrize("prompt,steps", [((6, 8), 4), ((11, 12), 5), ((13, 13), 3)])
def test_steps_skip_prompt_indices(prompt, steps, norms):
    """Prompts before the loss: each TTT step computes only the indices a counted target needs
    (`ttt_spans`), and loss, gradients and statistics still equal the reference that computes every index;
    (11, 12): the last steps have nothing left to score; (13, 13): no target counts at all."""
    head, input_ids, attention_mask, loss_mask, aux, tgt = _setup(norms=norms)
    loss_mask[0, :prompt[0]] = 0
    loss_mask[1, :prompt[1]] = 0
    valid = loss_mask.bool() & attention_mask.bool()
    spans = ttt_spans(valid, steps)
    if valid.any():
        assert spans[0][0] > 0  # the prompt's first indices are step-0 keys only
    assert all(a[0] <= b[0] and b[1] <= a[1] for a, b in zip(spans, spans[1:]))  # ranges shrink
    _assert_step_equals_reference(head, input_ids, attention_mask, loss_mask, aux, tgt, steps)


def test_soft_ce_chunks_and_gradient():
    torch.manual_seed(1)
    M, V = 3 * SoftCE.CHUNK + 5, 40  # several chunks and a partial one
    logits = torch.randn(M, V, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(torch.randn(M, V, dtype=torch.float64) * 3, -1)
    in_mass = torch.rand(M, dtype=torch.float64)
    w = torch.rand(M, dtype=torch.float64)
    ce, top, alpha = SoftCE.apply(logits, p, in_mass)
    (ce * w).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    ref = F.cross_entropy(logits, p, reduction="none")
    (ref * w).sum().backward()
    torch.testing.assert_close(ce, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, logits.grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(top, logits.argmax(-1))
    q = torch.softmax(logits.detach(), -1)
    torch.testing.assert_close(alpha, torch.minimum(q, p * in_mass[:, None]).sum(-1), rtol=1e-12, atol=1e-12)


def test_expected_acceptance_from_chains():
    """E[tau] = 1 + sum_k mean over anchors of prod_{i<k} acceptance; per anchor, not per-step means."""
    # two steps; step 0: 4 anchors, step 1: 3 of them still count. chain sums as eagle3_loss writes them
    rows = torch.zeros(2, len(STATS))
    col = {name: STATS.index(name) for name in STATS}
    rows[0, [col["correct"], col["alpha_sum"], col["metric_count"]]] = torch.tensor([3.0, 2.0, 4.0])
    rows[0, [col["chain_correct"], col["chain_alpha"], col["chain_count"]]] = torch.tensor([3.0, 2.0, 4.0])
    rows[1, [col["correct"], col["alpha_sum"], col["metric_count"]]] = torch.tensor([2.0, 1.5, 3.0])
    rows[1, [col["chain_correct"], col["chain_alpha"], col["chain_count"]]] = torch.tensor([1.0, 0.6, 3.0])
    out = summarize(rows)
    assert out["etau_greedy"] == pytest.approx(1 + 3 / 4 + 1 / 3)
    assert out["etau_sample"] == pytest.approx(1 + 2 / 4 + 0.6 / 3)
    # without chains (P-EAGLE's rows): products of the per-step means
    rows[:, [col["chain_correct"], col["chain_alpha"], col["chain_count"]]] = 0
    out = summarize(rows)
    assert out["etau_greedy"] == pytest.approx(1 + 3 / 4 + 3 / 4 * 2 / 3)
    assert out["etau_sample"] == pytest.approx(1 + 2 / 4 + 2 / 4 * 1.5 / 3)


def test_target_side_on_the_counted_rows_only():
    head, input_ids, attention_mask, loss_mask, aux, _ = _setup()
    target = load_target(TargetConfig(name="tiny", dtype="float64"))
    last = target.features(input_ids, attention_mask)[1]
    rows = loss_mask.bool() & attention_mask.bool()
    full = TargetHead(target.model.lm_head.weight, head.t2d)(last)
    part = TargetHead(target.model.lm_head.weight, head.t2d)(last, rows)
    for name in ("probs", "in_mass", "argmax", "argmax_in_draft"):
        torch.testing.assert_close(getattr(part, name)[rows], getattr(full, name)[rows], rtol=0, atol=0, msg=name)
        assert not getattr(part, name)[~rows].any(), name


def test_target_side_from_stored_statistics():
    """With data-gen's stored argmax and logsumexp (`top`, `lse`), only the draft rows of the lm_head are
    multiplied, and the target side equals the full-vocab recompute."""
    head, input_ids, attention_mask, loss_mask, aux, _ = _setup()
    target = load_target(TargetConfig(name="tiny", dtype="float64"))
    last = target.features(input_ids, attention_mask)[1]
    logits = target.logits(last)
    top, lse = logits.argmax(-1).to(torch.int32), torch.logsumexp(logits, -1)
    assert not bool(torch.isin(top, torch.nonzero(head.t2d).squeeze(1)).all())  # some argmaxes outside the draft
    rows = loss_mask.bool() & attention_mask.bool()
    full = TargetHead(target.model.lm_head.weight, head.t2d)(last, rows)
    stored = TargetHead(target.model.lm_head.weight, head.t2d)(last, rows, top, lse)
    for name in ("probs", "in_mass", "argmax", "argmax_in_draft"):
        torch.testing.assert_close(getattr(stored, name), getattr(full, name), rtol=1e-6, atol=1e-6, msg=name)  # float32 logits
