"""The EAGLE-3 training step: target distributions, the training-time-test (TTT) unroll, the loss.

Conventions (index t of a sequence x_0 .. x_{T-1}; f_t = the target's fused features at position t):

    step 0, index t:  token x_{t+1},   hidden fc(f_t),                 position t
    step i, index t:  token x_{t+1+i}, hidden = step i-1's PRE-norm output at t, position t+i
                      (its POST-norm output with method.norm_output: EAGLE-3.1, as vLLM drafts with it)
    target at step i, index t: softmax(target logits at position t+1+i) over the draft vocab
                               (t2d rows only, renormalised)
    loss  = sum_i 0.8^i * soft-CE(target probs, draft log-probs), averaged over positions where
            loss_mask[t+1+i] is set, t+1+i < T (inside the real sequence) and the target's argmax
            is in the draft vocab

Attention at step i: query t sees the step-0 keys 0..t and, in each later step j <= i, the key of
its own index t (its own branch one position further on): the mask `heads.eagle3.ttt_mask(T, i)`
describes, computed here as one causal (T, T) block plus one score per later step (`ttt_attention`).
So index t at step i is exactly what the drafter computes autoregressively after drafting i tokens
from position t (tests/test_train_eagle3.py checks this against a step-by-step decode, and
tests/test_train_speed.py the whole step against the head's own forward with the dense mask).

Each step runs the decoder layer only over the indices a counted target needs (`ttt_spans`: a prompt
before the first loss-masked position is computed once, as step-0 keys), and only the positions that
count pass the final norm, the lm_head and the loss (`SoftCE`: one pass over
row chunks for the loss, its gradient and the statistics).

Options beyond the TTT depth and decay (all off by default): the EAGLE-3.1 norms of the head (heads/eagle3.py:
`norm_before_fc`, `fc_norm`, `norm_output`) and `feature_noise`, uniform noise on the target's features while
training (`add_feature_noise`).

Logged per step i: loss, accuracy (draft argmax mapped to target ids == target argmax) and the
expected acceptance alpha_i = sum_v min(p_v, q_v), p the target's full-vocab probabilities on the
draft tokens, q the draft's. Accuracy and alpha count every loss-masked position, including those
whose target argmax lies outside the draft vocab (which the draft cannot get right; their share is
logged as outside_draft). From the per-anchor products of the steps' acceptances, the expected
acceptance length of a chain of the TTT depth, etau_greedy and etau_sample (`summarize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from draftsmith.core import checks
from draftsmith.heads.eagle3 import NORMS, Eagle3Head, eagle3_config_from_target
from draftsmith.train.features import TargetSide, target_prepare, vocab_map_for
from draftsmith.train.stats import CHAIN_STATS, STEP_STATS, summarize_steps


@dataclass
class Eagle3Config:
    """`method=eagle3`: the options of EAGLE-3 training (configs/method/eagle3.yaml).

    The feature layers are the target's (`target.aux_layer_ids`): data-gen captures them too."""

    name: str = "eagle3"  # the method (set by method=eagle3)
    draft_vocab_size: int = 32000  # the most frequent assistant tokens; capped at the target's vocab
    # training-time test: unrolled draft steps per position. 3, not the EAGLE-3 paper's (and SpecForge's) 7: at an
    # equal training budget a 3-step unroll makes twice the updates and its heads accepted more at K = 3 AND K = 7
    # (held-out τ +0.16 self-written, +0.06 Spec-Bench; docs/benchmarks.md, bench_vs_peers.py); speculators 0.9: 3
    ttt_steps: int = 3
    ttt_decay: float = 0.8  # loss weight of TTT step k is ttt_decay**k
    # the EAGLE-3.1 norms (heads/eagle3.py), exported under the names vLLM reads:
    norm_before_fc: bool = False  # EAGLE-3.1: one RMSNorm over the 3 concatenated target layers before fc (input_norm)
    fc_norm: bool = False  # EAGLE-3.1: one RMSNorm per target layer before fc (fc_norm.{i}); after input_norm if both
    norm_output: bool = False  # EAGLE-3.1: each step hands the next its POST-norm hidden (else the pre-norm one)
    # U(-feature_noise, feature_noise) added to every target feature while training, never in eval; 0 = off
    # (speculators' AddUniformNoise, 0.05 by default there before 0.9.0: `add_feature_noise`)
    feature_noise: float = 0.0

    def __post_init__(self):
        checks.one_of("method.name", self.name, ("eagle3",))
        checks.at_least("method.draft_vocab_size", self.draft_vocab_size, 1)
        checks.at_least("method.ttt_steps", self.ttt_steps, 1)
        checks.positive("method.ttt_decay", self.ttt_decay)
        checks.at_least("method.feature_noise", self.feature_noise, 0)


# Columns of the per-step statistics tensor `Eagle3Step.forward` returns, summed over positions (train/stats.py):
# the per-step ones and, since every TTT step drafts from the same anchors, the chain ones.
STATS = STEP_STATS + CHAIN_STATS
OFFLINE_DATA = "hidden_states"  # what mode=offline reads from a data-gen folder: the target's features

def ttt_spans(valid: torch.Tensor, steps: int) -> list[tuple[int, int]]:
    """For each TTT step i, the index range [lo, hi) the step must compute, given valid (B, T) = the
    positions whose target counts: index t of step i is needed when a target t+1+j, j >= i, counts (its
    own or a later step's draft from t is trained). The ranges shrink with i, so each step's later-step
    keys cover the next step's queries. Indices before the first loss-masked position (a prompt) are
    computed only as step-0 keys: that is the saving."""
    B, T = valid.shape
    spans, need = [], torch.zeros(T, dtype=torch.bool, device=valid.device)
    for k in range(steps, 0, -1):  # need_i = need_{i+1} | the targets of step i (k = 1 + i)
        need = need | F.pad(valid[:, k:], (0, min(k, T))).any(0)
        where = torch.nonzero(need).squeeze(1)
        spans.append((int(where[0]), int(where[-1]) + 1) if where.numel() else None)
    spans.reverse()
    lo = 0
    for i, span in enumerate(spans):  # an empty step: an empty range inside the previous one
        spans[i] = span if span is not None else (lo, lo)
        lo = spans[i][0]
    return spans


def ttt_hidden(head: Eagle3Head, input_ids: torch.Tensor, hidden: torch.Tensor,
               attention_mask: torch.Tensor, steps: int, spans: Optional[list[tuple[int, int]]] = None):
    """Yield the pre-norm hidden (B, hi - lo, H) of each TTT step over its index range [lo, hi) from `spans`
    (`ttt_spans`; default every index); index t of step i drafts x_{t+2+i}. The next step reads it, or with
    head.norm_output its final norm, as `head.forward` hands it on.

    input_ids (B, T) right-padded, hidden (B, T, H) = head.fuse(aux), attention_mask (B, T).

    The same maths as `head(tokens, hidden, positions + i, ttt_mask(T, i) & padding, ConcatKVCache)`
    per step (tests/test_train_speed.py checks it in float64), without the dense (T, (i+1)T) mask:
    the step-0 keys are scored as one causal (T, T) block and each later step's key only against its
    own index (a dot product per position), then one softmax over the T + i scores of each query.
    Index t of step i reads only index t of the earlier steps and the step-0 keys up to t, so a step
    computes just its range (and step 0 the keys and values of every index before its range's end).
    The embeddings, their norm and the rotary tables of all steps are computed once and sliced.
    """
    B, T = input_ids.shape
    spans = spans if spans is not None else [(0, T)] * steps
    layer = head.midlayer
    ext = F.pad(input_ids[:, 1:], (0, steps))  # step i, index t reads ext[t + i] = x_{t+1+i} (0 past the end)
    emb = layer.input_layernorm(head.embed_tokens(ext).to(hidden.dtype))  # (B, T-1+steps, H)
    positions = torch.arange(T - 1 + steps, device=input_ids.device)[None].expand(B, -1)
    cos_all, sin_all = head.rotary_emb(hidden, positions)
    end = spans[0][1]  # no query of any step lies at or past step 0's range end
    causal = torch.ones(T, end, dtype=torch.bool, device=input_ids.device).tril()
    step0_ok = (causal & attention_mask.bool()[:, None, :end])[:, None, None]  # (B, 1, 1, T, end)
    keys, values, los = [], [], []
    x0 = torch.cat([emb[:, :end], layer.hidden_norm(hidden[:, :end])], dim=-1)  # step 0's input, (B, end, 2H)
    prev_lo = 0
    for i, (lo, hi) in enumerate(spans):
        h_in = hidden[:, lo - prev_lo:hi - prev_lo]  # this range of the previous step's output (or of fc(f))
        if i > 0 and head.norm_output:
            h_in = head.norm(h_in)  # what the previous step hands on with norm_output (vLLM's aux_output)
        x = x0[:, lo:hi] if i == 0 else torch.cat([emb[:, i + lo:i + hi], layer.hidden_norm(h_in)], dim=-1)
        attn = ttt_attention(layer.self_attn, x, cos_all[:, i + lo:i + hi], sin_all[:, i + lo:i + hi], keys, values,
                             los, lo, step0_ok[..., lo:hi, :], x0 if i == 0 else None, cos_all[:, :end], sin_all[:, :end])
        h = h_in + attn
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        prev_lo = lo
        yield hidden


def ttt_attention(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: list, values: list,
                  los: list, lo: int, step0_ok: torch.Tensor, x0: Optional[torch.Tensor] = None,
                  cos0: Optional[torch.Tensor] = None, sin0: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of one TTT step over the query indices [lo, lo + len(x)) (appends this step's k, v and lo
    to `keys` / `values` / `los`): query t sees the step-0 keys allowed by `step0_ok` and, in each later
    step, the key of its own index t. Step 0 passes x0, its input at every index from 0, for its keys.

    Scores, softmax and the weighted sum run in at least float32 with autocast off (they are small:
    (T, T + i) per head), so bf16 training rounds only the projections."""
    B, T, _ = x.shape
    nh, nkv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = attn.q_proj(x).view(B, T, nh, d).transpose(1, 2)  # (B, nh, T, d)
    kv_in, kv_cos, kv_sin = (x0, cos0, sin0) if x0 is not None else (x, cos, sin)
    k = attn.k_proj(kv_in).view(B, -1, nkv, d).transpose(1, 2)  # (B, nkv, T or end, d)
    v = attn.v_proj(kv_in).view(B, -1, nkv, d).transpose(1, 2)
    q = q * cos[:, None] + rotate_half(q) * sin[:, None]
    k = k * kv_cos[:, None] + rotate_half(k) * kv_sin[:, None]
    acc = torch.promote_types(q.dtype, torch.float32)
    keys.append(k.to(acc))
    values.append(v.to(acc))
    los.append(0 if x0 is not None else lo)
    with torch.autocast(device_type=x.device.type, enabled=False):
        # head h reads kv head h // rep (repeat_interleave's order): group the query heads by kv head
        qg = q.to(acc).reshape(B, nkv, nh // nkv, T, d) * d ** -0.5  # (B, nkv, rep, T, d)
        s0 = (qg @ keys[0][:, :, None].transpose(-1, -2)).masked_fill(~step0_ok, float("-inf"))  # (B, nkv, rep, T, end)
        own = [slice(lo - lj, lo - lj + T) for lj in los[1:]]  # this range inside each later step's range
        later = [(qg * kj[:, :, None, o]).sum(-1, keepdim=True) for kj, o in zip(keys[1:], own)]  # (B, nkv, rep, T, 1)
        n0 = s0.shape[-1]
        w = torch.softmax(torch.cat([s0, *later], dim=-1), dim=-1)
        y = w[..., :n0] @ values[0][:, :, None]  # (B, nkv, rep, T, d)
        for j, (vj, o) in enumerate(zip(values[1:], own)):
            y = y + w[..., n0 + j:n0 + j + 1] * vj[:, :, None, o]
    y = y.reshape(B, nh, T, d).transpose(1, 2).reshape(B, T, nh * d).to(x.dtype)
    return attn.o_proj(y)


def ttt_unroll(head: Eagle3Head, input_ids: torch.Tensor, hidden: torch.Tensor,
               attention_mask: torch.Tensor, steps: int):
    """Yield the draft logits (B, T, Vd) of each TTT step; index t of step i drafts x_{t+2+i} (for tests:
    the loss takes the logits of the positions that count only)."""
    for h in ttt_hidden(head, input_ids, hidden, attention_mask, steps):
        yield head.lm_head(head.norm(h))


class SoftCE(torch.autograd.Function):
    """Soft cross-entropy of draft logits (M, Vd) against target probs p (M, Vd), with the statistics.

    One pass over row chunks computes in float32 (float64 stays float64): ce = -sum_v p_v log q_v, the
    draft's argmax, alpha = sum_v min(q_v, p_v * in_mass) and the gradient of ce with respect to the
    logits, q * sum(p) - p, kept for backward (which is then one multiply): the log-softmax is computed
    once, for the loss and the statistics alike. Returns (ce (M,), argmax (M,), alpha (M,)); only ce
    has a gradient."""

    CHUNK = 32  # rows per chunk: the chunk's (CHUNK, Vd) temporaries stay in cache

    @staticmethod
    def forward(ctx, logits, p, in_mass):
        M, V = logits.shape
        acc = torch.promote_types(logits.dtype, torch.float32)
        grad = torch.empty(M, V, dtype=acc, device=logits.device)
        ce = torch.empty(M, dtype=acc, device=logits.device)
        alpha = torch.empty(M, dtype=acc, device=logits.device)
        top = torch.empty(M, dtype=torch.long, device=logits.device)
        for a in range(0, M, SoftCE.CHUNK):  # in place on the chunk's own copy: few passes, few allocations
            b = min(a + SoftCE.CHUNK, M)
            z = logits[a:b].to(acc, copy=True)
            pc = p[a:b].to(acc)
            zmax, top[a:b] = z.max(dim=-1)
            z.sub_(zmax[:, None])
            pz = torch.linalg.vecdot(pc, z)  # sum_v p_v z_v
            q = z.exp_()
            s = q.sum(-1)
            psum = pc.sum(-1)
            ce[a:b] = s.log() * psum - pz  # -sum p (z - log s)
            q.div_(s[:, None])
            alpha[a:b] = torch.minimum(q, pc * in_mass[a:b, None].to(acc)).sum(-1)
            torch.sub(q.mul_(psum[:, None]), pc, out=grad[a:b])
        ctx.save_for_backward(grad)
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(top, alpha)
        return ce, top, alpha

    @staticmethod
    def backward(ctx, grad_ce, _top, _alpha):
        (grad,) = ctx.saved_tensors
        return (grad * grad_ce[:, None].to(grad.dtype)).to(ctx.logits_dtype), None, None


def eagle3_loss(head: Eagle3Head, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                loss_mask: torch.Tensor, aux: torch.Tensor, target: TargetSide,
                steps: int = 7, decay: float = 0.8) -> tuple[torch.Tensor, torch.Tensor]:
    """The TTT loss of one micro-batch and its statistics (steps, len(STATS)) for logging.

    Only the positions that count (loss-masked, inside the sequence) go through the final norm,
    the lm_head and the loss: the others contribute to neither the loss nor the statistics."""
    B, T = input_ids.shape
    valid = loss_mask.bool() & attention_mask.bool()  # (B, T): positions whose target counts
    hidden = head.fuse(aux)  # (B, T, H)
    loss = hidden.new_zeros((), dtype=torch.float32)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    chain_ok = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)  # anchors whose targets so far all count
    chain_correct = torch.ones(B, T, dtype=acc, device=input_ids.device)  # prod of [draft argmax right] so far
    chain_alpha = torch.ones(B, T, dtype=acc, device=input_ids.device)  # prod of alpha so far
    stats = []
    spans = ttt_spans(valid, steps)
    for i, h in enumerate(ttt_hidden(head, input_ids, hidden, attention_mask, steps, spans)):
        k = 1 + i  # index t is scored against the target at position t + k
        m_metric = F.pad(valid[:, k:], (0, min(k, T)))  # (B, T): index t's target counts
        b_idx, t_idx = torch.nonzero(m_metric, as_tuple=True)  # (M,) the rows that count, inside step i's span
        logits = head.lm_head(head.norm(h[b_idx, t_idx - spans[i][0]]))  # (M, Vd)
        p = target.probs[b_idx, t_idx + k]  # (M, Vd)
        in_draft = target.argmax_in_draft[b_idx, t_idx + k]  # (M,) the loss's rows
        ce, top, alpha = SoftCE.apply(logits, p, target.in_mass[b_idx, t_idx + k])
        n_loss = in_draft.sum()
        loss_i = (ce * in_draft).sum() / n_loss.clamp(min=1)
        loss = loss + decay ** i * loss_i
        with torch.no_grad():
            correct = head.draft_to_target(top) == target.argmax[b_idx, t_idx + k]  # (M,)
            chain_ok &= m_metric
            chain_correct[b_idx, t_idx] *= correct.to(acc)
            chain_alpha[b_idx, t_idx] *= alpha.to(acc)
            chain_correct *= m_metric
            chain_alpha *= m_metric
            stats.append(torch.stack([loss_i.detach().float() * n_loss, n_loss.float(), correct.sum().float(),
                                      alpha.float().sum(), m_metric.sum().float(), (~in_draft).sum().float(),
                                      chain_correct.sum().float(), chain_alpha.sum().float(), chain_ok.sum().float()]))
    return loss, torch.stack(stats)


def add_feature_noise(aux: torch.Tensor, scale: float) -> torch.Tensor:
    """aux + U(-scale, scale), element-wise and absolute (not relative to the features' size), as speculators'
    `AddUniformNoise` did: `tensor + 2 * (rand_like(tensor) - 0.5) * std`, std 0.05 by default (its
    train/noise_transforms.py before 0.9.0, whose training loader no longer adds any noise), applied by its data
    loader to the training rows' `hidden_states`, the concatenated target layers that go into fc, and never to the
    verifier's last hidden state (the targets) nor to the validation rows. Here too: on the (B, T, 3H_t) features,
    before input_norm / fc_norm / fc, the target distributions untouched.

    Deterministic under the run's seed, and exact on resume: the noise is drawn on aux's device by a generator
    seeded from one draw of torch's CPU generator, which the run seeds and every checkpoint saves per rank (as
    P-EAGLE's and DFlash's sampling draw from it)."""
    seed = int(torch.randint(0, 2 ** 62, ()))
    g = torch.Generator(device=aux.device).manual_seed(seed)
    u = torch.rand(aux.shape, generator=g, device=aux.device, dtype=aux.dtype)  # U[0, 1)
    return aux + (2 * u - 1) * scale


class Eagle3Step(nn.Module):
    """The trainable module the trainer wraps: the drafter plus its loss (the target stays outside).

    forward(batch) -> (loss, stats); batch holds input_ids, attention_mask, loss_mask, aux and the
    TargetSide computed by `TargetHead` beforehand. `drafter` is what checkpoints and final/ hold.
    With feature_noise > 0 the features are noised in training mode only: the trainer's held-out evaluation runs the
    module in eval mode, on the clean features (as speculators noises its training set, not its validation set).
    """

    def __init__(self, drafter: Eagle3Head, steps: int, decay: float, feature_noise: float = 0.0):
        super().__init__()
        self.drafter, self.steps, self.decay, self.feature_noise = drafter, steps, decay, feature_noise

    def forward(self, input_ids, attention_mask, loss_mask, aux, target: TargetSide):
        if self.training and self.feature_noise > 0:  # off: nothing is drawn, the step is the one without noise
            aux = add_feature_noise(aux.to(self.drafter.fc.weight.dtype), self.feature_noise)  # in the weights' dtype
        return eagle3_loss(self.drafter, input_ids, attention_mask, loss_mask, aux, target, self.steps, self.decay)


# ---- the method table's entry points (draftsmith.core.methods) ----------------------------------------

def new_eagle3(target, cfg: Eagle3Config, train, resume: Optional[Path]) -> Eagle3Head:
    """A head for `target`: the vocab map from the training rows' assistant tokens (or, on resume,
    from the checkpoint: never rebuilt), embeddings and lm_head rows copied from the target."""
    d2t, t2d = vocab_map_for(target, cfg.draft_vocab_size, train, resume)
    head = Eagle3Head(eagle3_config_from_target(target.model.config, d2t.numel(),
                                                **{name: getattr(cfg, name) for name in NORMS}))
    head.init_from_target(target.model, d2t, t2d)
    return head


def eagle3_training(head: Eagle3Head, target, cfg: Eagle3Config, mode: str,
                    autocast: Callable) -> tuple[Eagle3Step, Callable[[dict], dict]]:
    """(the module to train, `prepare(batch)`): prepare adds the target side under no_grad:
    features (online: the target runs; offline: the batch carries them) and its distributions."""
    return (Eagle3Step(head, cfg.ttt_steps, cfg.ttt_decay, cfg.feature_noise),
            target_prepare(head.t2d, target, mode, autocast))


# the method table's hooks (draftsmith.core.methods)
Config = Eagle3Config
new_drafter = new_eagle3
training = eagle3_training
summarize = partial(summarize_steps, columns=STATS)  # metrics and E[tau] from the summed statistics
