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
its own index t (its own branch one position further on): the dense mask `ttt_mask(T, i)` (tests/helpers.py)
describes, computed here as one causal (T, T) block plus one score per later step (`ttt_attention`).
So index t at step i is exactly what the drafter computes autoregressively after drafting i tokens
from position t (tests/test_train_eagle3.py checks this against a step-by-step decode, and
tests/test_train_speed.py the whole step against the head's own forward with the dense mask).

The step has two paths with the same maths (tests/test_train_eagle3_gpu_step.py checks them in float64).
The CPU path (the default there) runs each step's decoder layer only over the indices a counted target needs
(`ttt_spans`: a prompt before the first loss-masked position is computed once, as step-0 keys) and gathers only
the positions that count into the final norm, the lm_head and the loss; that costs a few host syncs per step. The
device path (`sync_free`, the default off the CPU) computes every index and masks the rows that do not count: no
host sync in the step. `SoftCE` is one pass over row chunks for the loss, its gradient and the statistics, 32 rows
on the CPU, larger on a GPU (`loss_chunk_rows`).

method.attention picks the kernel over the step-0 keys (`ATTENTION`): dense (explicit float32 scores, memory ~ T^2:
the reference and the CPU's) or flex (flex attention with a block mask, memory ~ T: auto on CUDA). A packed
micro-batch (several conversations per row) carries position_ids and document_ids: positions restart per document,
attention and TTT targets stay inside one. method.activation_checkpointing recomputes each step's layer in backward.

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
from functools import cache, partial
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import rotate_half

from ..core import checks
from ..core.method_hooks import TrainingHooks
from ..heads.eagle3 import NORMS, Eagle3Head, eagle3_config_from_target
from .features import TargetSide, target_prepare, vocab_map_for
from .stats import CHAIN_STATS, STEP_STATS, summarize_steps


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
    # the TTT attention kernel: dense (explicit float32 scores, memory ~ T^2: the reference), flex (flex attention
    # with a block mask, memory ~ T; compiled on CUDA; no backward on CPU), auto = flex on CUDA, dense elsewhere
    attention: str = "auto"
    # recompute each TTT step's decoder layer in backward instead of keeping its activations (long sequences)
    activation_checkpointing: bool = False

    def __post_init__(self):
        checks.one_of("method.name", self.name, ("eagle3",))
        checks.one_of("method.attention", self.attention, ATTENTIONS)
        checks.at_least("method.draft_vocab_size", self.draft_vocab_size, 1)
        checks.at_least("method.ttt_steps", self.ttt_steps, 1)
        checks.positive("method.ttt_decay", self.ttt_decay)
        checks.at_least("method.feature_noise", self.feature_noise, 0)


# Columns of the per-step statistics tensor `Eagle3Step.forward` returns, summed over positions (train/stats.py):
# the per-step ones and, since every TTT step drafts from the same anchors, the chain ones.
STATS = STEP_STATS + CHAIN_STATS
OFFLINE_DATA = "hidden_states"  # what mode=offline reads from a data-gen folder: the target's features

def counted_targets(valid: torch.Tensor, k: int, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, T) bool: index t's target at position t + k counts, given valid (B, T) = the positions whose target
    counts: t + k lies inside the row, is valid and, in a packed row (document_ids (B, T)), in t's own document
    (a draft from t never reaches across into the next conversation)."""
    T = valid.shape[1]
    counted = F.pad(valid[:, k:], (0, min(k, T)))
    if document_ids is not None:
        counted = counted & (document_ids == F.pad(document_ids[:, k:], (0, min(k, T)), value=-1))
    return counted


def ttt_spans(valid: torch.Tensor, steps: int, document_ids: Optional[torch.Tensor] = None) -> list[tuple[int, int]]:
    """For each TTT step i, the index range [lo, hi) the step must compute, given valid (B, T) = the
    positions whose target counts: index t of step i is needed when a target t+1+j, j >= i, counts (its
    own or a later step's draft from t is trained). The ranges shrink with i, so each step's later-step
    keys cover the next step's queries. Indices before the first loss-masked position (a prompt) are
    computed only as step-0 keys: that is the saving. Two host syncs per step: the CPU path's."""
    B, T = valid.shape
    found: list[Optional[tuple[int, int]]] = []  # per step, from the last: its range, None when empty
    need = torch.zeros(T, dtype=torch.bool, device=valid.device)
    for k in range(steps, 0, -1):  # need_i = need_{i+1} | the targets of step i (k = 1 + i)
        need = need | counted_targets(valid, k, document_ids).any(0)
        where = torch.nonzero(need).squeeze(1)
        found.append((int(where[0]), int(where[-1]) + 1) if where.numel() else None)
    found.reverse()
    spans: list[tuple[int, int]] = []
    lo = 0
    for span in found:  # an empty step: an empty range inside the previous one
        spans.append(span if span is not None else (lo, lo))
        lo = spans[-1][0]
    return spans


# ---- the step-0 keys' mask and the attention kernels (method.attention) -----------------------------------------
#
# Query t (any step) sees the step-0 key s when s <= t, s is a real token (attention_mask) and s lies in t's document
# (document_ids, packing), and always its own index s = t: a padding query then still has one key (no softmax over
# nothing, no NaN in a row nobody reads). Each builder takes (attention_mask (B, T), document_ids (B, T) or None,
# end = the step-0 keys [0, end)) and returns mask(lo, hi): the mask of the queries [lo, hi), what its kernel reads.

def dense_step0_mask(attention_mask: torch.Tensor, document_ids: Optional[torch.Tensor], end: int) -> Callable:
    """The mask as bools (B, 1, 1, T, end), sliced per step's queries."""
    T = attention_mask.shape[1]
    key_ok = attention_mask.bool()[:, None, :end]  # (B, 1, end)
    if document_ids is not None:
        key_ok = key_ok & (document_ids[:, :, None] == document_ids[:, None, :end])  # (B, T, end)
    own = torch.eye(T, end, dtype=torch.bool, device=attention_mask.device)
    ok = (torch.ones(T, end, dtype=torch.bool, device=attention_mask.device).tril() & (key_ok | own))[:, None, None]
    return lambda lo, hi: ok[..., lo:hi, :]


FLEX_PAD = 128  # flex's block size: its kernels may read the mask's tensors this far past the last index


def flex_step0_mask(attention_mask: torch.Tensor, document_ids: Optional[torch.Tensor], end: int) -> Callable:
    """The mask as a flex BlockMask per query range (built once per range: on the device path every step has the
    same range [0, T), so one per micro-batch); blocks wholly masked (the future, other documents) are skipped."""
    B, T = attention_mask.shape
    key_ok = F.pad(attention_mask.bool(), (0, FLEX_PAD))  # (B, T + pad)
    doc = F.pad(document_ids if document_ids is not None else torch.zeros_like(attention_mask), (0, FLEX_PAD), value=-1)
    masks = {}

    def mask(lo: int, hi: int):
        if (lo, hi) not in masks:
            def step0_ok(b, h, q_idx, kv_idx):
                q = q_idx + lo
                return (kv_idx <= q) & ((key_ok[b, kv_idx] & (doc[b, kv_idx] == doc[b, q])) | (kv_idx == q))
            masks[lo, hi] = create_block_mask(step0_ok, B, None, hi - lo, end, device=attention_mask.device)
        return masks[lo, hi]
    return mask


def dense_kernel(q, qg, k0, v0, mask, later, later_values):
    """Explicit scores over the step-0 keys (B, nkv, rep, n, end) beside the later steps' own-index scores, one
    softmax over both: the reference (memory grows with n * end)."""
    s0 = (qg @ k0[:, :, None].transpose(-1, -2)).masked_fill(~mask, float("-inf"))  # (B, nkv, rep, n, end)
    n0 = s0.shape[-1]
    w = torch.softmax(torch.cat([s0, *later], dim=-1), dim=-1)
    y = w[..., :n0] @ v0[:, :, None]  # (B, nkv, rep, n, d)
    for j, vj in enumerate(later_values):
        y = y + w[..., n0 + j:n0 + j + 1] * vj
    return y


def flex_kernel(q, qg, k0, v0, mask, later, later_values):
    """Flex attention over the step-0 keys (memory linear in n), then the later steps' keys merged in exactly:
    the step-0 block enters the softmax as one score, its logsumexp, with its normalised output as value
    (softmax over [lse0, s_1 .. s_i] = [Z0, e^s_1 .. e^s_i] / Z). The kernel reads q, k, v in the projections'
    dtype (bf16 under autocast: tensor cores) and accumulates in float32; the merge runs in qg's dtype."""
    B, nkv, rep, n, d = qg.shape
    flex = flex_attention if q.device.type == "cpu" else compiled_flex_attention()
    o0, aux = flex(q, k0.to(q.dtype), v0.to(q.dtype), block_mask=mask, scale=d ** -0.5, enable_gqa=True,
                   return_aux=AuxRequest(lse=True))  # (B, nh, n, d), lse (B, nh, n)
    o0 = o0.to(qg.dtype).reshape(B, nkv, rep, n, d)  # query head h reads kv head h // rep, as repeat_interleave
    lse0 = aux.lse.to(qg.dtype).reshape(B, nkv, rep, n, 1)
    w = torch.softmax(torch.cat([lse0, *later], dim=-1), dim=-1)  # (B, nkv, rep, n, 1 + i)
    y = w[..., :1] * o0
    for j, vj in enumerate(later_values):
        y = y + w[..., 1 + j:2 + j] * vj
    return y


@cache
def compiled_flex_attention() -> Callable:
    """flex_attention compiled (on CUDA it is only fast compiled); compiled on its first call, once per shape
    family (automatic dynamic shapes after the first change)."""
    return torch.compile(flex_attention)


# method.attention -> (step-0 mask builder, kernel); "auto" resolves by device (`attention_for`)
ATTENTION = {"dense": (dense_step0_mask, dense_kernel), "flex": (flex_step0_mask, flex_kernel)}
ATTENTIONS = ("auto", *ATTENTION)


def attention_for(name: str, device: torch.device) -> str:
    """method.attention resolved: auto = flex on CUDA (memory linear in T), dense elsewhere (on CPU the dense
    kernel is the fast one, and flex has no CPU backward)."""
    if name == "auto":
        return "flex" if device.type == "cuda" else "dense"
    return name


def ttt_hidden(head: Eagle3Head, input_ids: torch.Tensor, hidden: torch.Tensor,
               attention_mask: torch.Tensor, steps: int, spans: Optional[list[tuple[int, int]]] = None,
               position_ids: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None,
               attention: str = "dense", activation_checkpointing: bool = False):
    """Yield the pre-norm hidden (B, hi - lo, H) of each TTT step over its index range [lo, hi) from `spans`
    (`ttt_spans`; default every index); index t of step i drafts x_{t+2+i}. The next step reads it, or with
    head.norm_output its final norm, as `head.forward` hands it on.

    input_ids (B, T) right-padded, hidden (B, T, H) = head.fuse(aux), attention_mask (B, T). Packed rows carry
    position_ids (B, T) (restarting at 0 per document; step i at index t sits at position_ids[t] + i) and
    document_ids (B, T) (attention stays inside a document); without them a row is one document at 0 .. T-1.
    `attention`: "dense" or "flex" (`ATTENTION`); activation_checkpointing recomputes each step's layer in backward.

    The same maths as `head(tokens, hidden, positions + i, ttt_mask(T, i) & padding, ConcatKVCache)` (tests/helpers.py)
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
    if position_ids is None:  # one document per row: step i at index t sits at t + i, one table for every step
        cos_all, sin_all = head.rotary_emb(hidden, torch.arange(T - 1 + steps, device=input_ids.device)[None].expand(B, -1))
        at = lambda i, lo, hi: slice(i + lo, i + hi)  # noqa: E731 - the table's columns of step i's [lo, hi)
    else:  # packed: positions restart per document, step i at index t sits at position_ids[t] + i
        shifted = position_ids[:, None, :] + torch.arange(steps, device=input_ids.device)[:, None]  # (B, steps, T)
        cos_all, sin_all = head.rotary_emb(hidden, shifted.flatten(1))  # (B, steps * T, d)
        at = lambda i, lo, hi: slice(i * T + lo, i * T + hi)  # noqa: E731
    end = spans[0][1]  # no query of any step lies at or past step 0's range end
    build_mask, kernel = ATTENTION[attention]
    step0_mask = build_mask(attention_mask, document_ids, end)
    x0 = torch.cat([emb[:, :end], layer.hidden_norm(hidden[:, :end])], dim=-1)  # step 0's input, (B, end, 2H)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    los: list[int] = []
    prev_lo = 0
    for i, (lo, hi) in enumerate(spans):
        h_in = hidden[:, lo - prev_lo:hi - prev_lo]  # this range of the previous step's output (or of fc(f))
        first = (x0, cos_all[:, at(0, 0, end)], sin_all[:, at(0, 0, end)]) if i == 0 else (None, None, None)
        args = (head, i, h_in, emb[:, i + lo:i + hi], cos_all[:, at(i, lo, hi)], sin_all[:, at(i, lo, hi)],
                step0_mask(lo, hi), kernel, tuple(keys), tuple(values), tuple(los), lo, *first)
        if activation_checkpointing:  # keep only the step's output, k and v; recompute the rest in backward
            hidden, k, v = checkpoint(ttt_step, *args, use_reentrant=False)
        else:
            hidden, k, v = ttt_step(*args)
        keys.append(k)
        values.append(v)
        los.append(0 if i == 0 else lo)
        prev_lo = lo
        yield hidden


def ttt_step(head: Eagle3Head, i: int, h_in: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             mask, kernel: Callable, keys: tuple, values: tuple, los: tuple, lo: int,
             x0: Optional[torch.Tensor] = None, cos0: Optional[torch.Tensor] = None, sin0: Optional[torch.Tensor] = None):
    """TTT step i's decoder layer over its queries [lo, lo + n): h_in (B, n, H) the previous step's output (or fc(f)),
    emb (B, n, H) the normed embeddings of its tokens. Returns (its pre-norm output (B, n, H), its keys and values).
    A pure function of its arguments (the earlier steps' keys come in as tuples), so checkpointing can rerun it."""
    layer = head.midlayer
    if i > 0 and head.norm_output:
        h_in = head.norm(h_in)  # what the previous step hands on with norm_output (vLLM's aux_output)
    if i == 0:
        assert x0 is not None  # step 0's input, given to step 0
        x = x0[:, lo:lo + h_in.shape[1]]  # (B, n, 2H)
    else:
        x = torch.cat([emb, layer.hidden_norm(h_in)], dim=-1)  # (B, n, 2H)
    attn, k, v = ttt_attention(layer.self_attn, x, cos, sin, mask, kernel, keys, values, los, lo, x0, cos0, sin0)
    h = h_in + attn
    return h + layer.mlp(layer.post_attention_layernorm(h)), k, v


def ttt_attention(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask, kernel: Callable,
                  keys: tuple, values: tuple, los: tuple, lo: int, x0: Optional[torch.Tensor] = None,
                  cos0: Optional[torch.Tensor] = None, sin0: Optional[torch.Tensor] = None):
    """Attention of one TTT step over the query indices [lo, lo + len(x)): query t sees the step-0 keys allowed by
    `mask` and, in each later step, the key of its own index t. keys / values / los: the earlier steps' (each
    step's lo; 0 for step 0). Step 0 passes x0, its input at every index from 0, for its keys. Returns (the output,
    this step's k and v).

    Scores, softmax and the weighted sum run in at least float32 with autocast off (they are small:
    (T, T + i) per head), so bf16 training rounds only the projections."""
    B, T, _ = x.shape
    nh, nkv, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = attn.q_proj(x).view(B, T, nh, d).transpose(1, 2)  # (B, nh, T, d)
    if x0 is not None:
        assert cos0 is not None and sin0 is not None  # given with x0
        kv_in, kv_cos, kv_sin = x0, cos0, sin0
    else:
        kv_in, kv_cos, kv_sin = x, cos, sin
    k = attn.k_proj(kv_in).view(B, -1, nkv, d).transpose(1, 2)  # (B, nkv, T or end, d)
    v = attn.v_proj(kv_in).view(B, -1, nkv, d).transpose(1, 2)
    q = q * cos[:, None] + rotate_half(q) * sin[:, None]
    k = k * kv_cos[:, None] + rotate_half(k) * kv_sin[:, None]
    acc = torch.promote_types(q.dtype, torch.float32)
    k, v = k.to(acc), v.to(acc)
    # step 0 reads its own keys; step i > 0 the step-0 keys and the later steps' 1 .. i (its own the last)
    k0, v0 = (k, v) if x0 is not None else (keys[0], values[0])
    later_k, later_v, later_lo = ((), (), ()) if x0 is not None else (keys[1:] + (k,), values[1:] + (v,), los[1:] + (lo,))
    with torch.autocast(device_type=x.device.type, enabled=False):
        # head h reads kv head h // rep (repeat_interleave's order): group the query heads by kv head
        qg = q.to(acc).reshape(B, nkv, nh // nkv, T, d) * d ** -0.5  # (B, nkv, rep, T, d)
        own = [slice(lo - lj, lo - lj + T) for lj in later_lo]  # this range inside each later step's range
        later = [(qg * kj[:, :, None, o]).sum(-1, keepdim=True) for kj, o in zip(later_k, own)]  # (B, nkv, rep, T, 1)
        y = kernel(q, qg, k0, v0, mask, later, [vj[:, :, None, o] for vj, o in zip(later_v, own)])
    y = y.reshape(B, nh, T, d).transpose(1, 2).reshape(B, T, nh * d).to(x.dtype)
    return attn.o_proj(y), k, v


# the soft-CE's temporaries per chunk off the CPU: about 3 (rows, Vd) float32 tensors within this budget
LOSS_CHUNK_BYTES = 512 * 2 ** 20


def loss_chunk_rows(device: torch.device, vocab: int) -> int:
    """SoftCE's rows per chunk: 32 on the CPU (the chunk stays in cache), else as many as LOSS_CHUNK_BYTES holds
    (a GPU wants few, large kernels)."""
    if device.type == "cpu":
        return SoftCE.CHUNK
    return max(SoftCE.CHUNK, LOSS_CHUNK_BYTES // (3 * 4 * vocab))


class SoftCE(torch.autograd.Function):
    """Soft cross-entropy of draft logits (M, Vd) against target probs p (M, Vd), with the statistics.

    One pass over row chunks (`chunk` rows; `loss_chunk_rows` sizes it for the device) computes in float32
    (float64 stays float64): ce = -sum_v p_v log q_v, the draft's argmax, alpha = sum_v min(q_v, p_v * in_mass)
    and the gradient of ce with respect to the logits, q * sum(p) - p, kept for backward (which is then one
    multiply): the log-softmax is computed once, for the loss and the statistics alike. Each row is computed
    alone, so nothing depends on the chunk size. Returns (ce (M,), argmax (M,), alpha (M,)); only ce has a
    gradient."""

    CHUNK = 32  # rows per chunk on the CPU: the chunk's (CHUNK, Vd) temporaries stay in cache

    @staticmethod
    def forward(ctx, logits, p, in_mass, chunk: int = CHUNK):
        M, V = logits.shape
        acc = torch.promote_types(logits.dtype, torch.float32)
        grad = torch.empty(M, V, dtype=acc, device=logits.device)
        ce = torch.empty(M, dtype=acc, device=logits.device)
        alpha = torch.empty(M, dtype=acc, device=logits.device)
        top = torch.empty(M, dtype=torch.long, device=logits.device)
        for a in range(0, M, chunk):  # in place on the chunk's own copy: few passes, few allocations
            b = min(a + chunk, M)
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
        return (grad * grad_ce[:, None].to(grad.dtype)).to(ctx.logits_dtype), None, None, None


def gathered_rows(h: torch.Tensor, lo: int, counted: torch.Tensor, target: TargetSide, k: int):
    """The CPU path: only the rows that count, gathered (a host sync each: nonzero). h (B, n, H) over the step's
    range from lo. Returns (h rows (M, H), their target side (p (M, Vd), in_mass, argmax, in_draft), counted (M,)
    (all true), place(chain, per_row): multiply a (B, T) chain by per-row values)."""
    b_idx, t_idx = torch.nonzero(counted, as_tuple=True)  # (M,) the rows that count, inside the step's range
    rows = (target.probs[b_idx, t_idx + k], target.in_mass[b_idx, t_idx + k], target.argmax[b_idx, t_idx + k],
            target.argmax_in_draft[b_idx, t_idx + k])

    def place(chain, per_row):
        chain[b_idx, t_idx] *= per_row
    return h[b_idx, t_idx - lo], rows, torch.ones_like(b_idx, dtype=torch.bool), place


def masked_rows(h: torch.Tensor, lo: int, counted: torch.Tensor, target: TargetSide, k: int):
    """The device path: every index t < T - k (a view, no host sync), the ones that do not count masked out
    afterwards. h (B, T, H) over the whole row (lo = 0). Returns what `gathered_rows` does, M = B * (T - k)."""
    B, T = counted.shape
    n = max(T - k, 0)  # index t is scored against t + k < T

    def flat(x):  # (B, T - k, ...) -> (B * (T - k), ...)
        return x.flatten(0, 1)
    rows = (flat(target.probs[:, k:]), flat(target.in_mass[:, k:]), flat(target.argmax[:, k:]),
            flat(target.argmax_in_draft[:, k:]))

    def place(chain, per_row):
        chain[:, :n] *= per_row.view(B, n)
    return flat(h[:, :n]), rows, flat(counted[:, :n]), place


def eagle3_loss(head: Eagle3Head, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                loss_mask: torch.Tensor, aux: torch.Tensor, target: TargetSide,
                steps: int, decay: float = Eagle3Config.ttt_decay, position_ids: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None, attention: str = "auto",
                sync_free: Optional[bool] = None, loss_chunk: Optional[int] = None,
                activation_checkpointing: bool = False, reduction: str = "mean") -> tuple[torch.Tensor, torch.Tensor]:
    """The TTT loss of one micro-batch and its statistics (steps, len(STATS)) for logging.

    reduction "mean" (training): sum_i decay^i * (the mean soft-CE over step i's loss rows); "sum": sum_i decay^i *
    (their sum), the summed loss, which adds up over conversations (a packed micro-batch's equals the sum of its
    conversations' one by one). Step i's loss rows: index t whose target t + 1 + i counts (loss-masked, inside
    the row and, packed, inside t's document: `counted_targets`) and whose target argmax is in the draft vocab.

    position_ids / document_ids (B, T): a packed micro-batch (`ttt_hidden`); absent, each row is one conversation.
    attention: method.attention (`attention_for`). sync_free (default: off the CPU): compute every index and mask
    the rows that do not count, with no host sync; else (the CPU path) each step computes only its `ttt_spans`
    range and gathers the rows that count: less work, a few host syncs. loss_chunk: SoftCE's rows per chunk
    (default `loss_chunk_rows`). Neither changes the result."""
    checks.one_of("reduction", reduction, ("mean", "sum"))
    B, T = input_ids.shape
    device = input_ids.device
    sync_free = device.type != "cpu" if sync_free is None else sync_free
    valid = loss_mask.bool() & attention_mask.bool()  # (B, T): positions whose target counts
    hidden = head.fuse(aux)  # (B, T, H)
    loss = hidden.new_zeros((), dtype=torch.float32)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    chain_ok = torch.ones(B, T, dtype=torch.bool, device=device)  # anchors whose targets so far all count
    chain_correct = torch.ones(B, T, dtype=acc, device=device)  # prod of [draft argmax right] so far
    chain_alpha = torch.ones(B, T, dtype=acc, device=device)  # prod of alpha so far
    chunk = loss_chunk or loss_chunk_rows(device, head.lm_head.out_features)
    spans = [(0, T)] * steps if sync_free else ttt_spans(valid, steps, document_ids)
    rows_of = masked_rows if sync_free else gathered_rows
    stats = []
    unroll = ttt_hidden(head, input_ids, hidden, attention_mask, steps, spans, position_ids, document_ids,
                        attention_for(attention, device), activation_checkpointing)
    for i, h in enumerate(unroll):
        k = 1 + i  # index t is scored against the target at position t + k
        m_metric = counted_targets(valid, k, document_ids)  # (B, T): index t's target counts
        h_rows, (p, in_mass, argmax, in_draft), counted, place = rows_of(h, spans[i][0], m_metric, target, k)
        logits = head.lm_head(head.norm(h_rows))  # (M, Vd)
        ce, top, alpha = SoftCE.apply(logits, p, in_mass, chunk)
        in_loss = in_draft & counted  # (M,) the loss's rows
        n_loss = in_loss.sum()
        ce_sum = (ce * in_loss).sum()
        loss_i = ce_sum / n_loss.clamp(min=1)
        loss = loss + decay ** i * (loss_i if reduction == "mean" else ce_sum)
        with torch.no_grad():
            correct = (head.draft_to_target(top) == argmax) & counted  # (M,)
            chain_ok &= m_metric
            place(chain_correct, correct.to(acc))
            place(chain_alpha, alpha.to(acc))
            chain_correct *= m_metric
            chain_alpha *= m_metric
            stats.append(torch.stack([loss_i.detach().float() * n_loss, n_loss.float(), correct.sum().float(),
                                      (alpha * counted).float().sum(), m_metric.sum().float(),
                                      (counted & ~in_draft).sum().float(), chain_correct.sum().float(),
                                      chain_alpha.sum().float(), chain_ok.sum().float()]))
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
    TargetSide computed by `TargetHead` beforehand, and for a packed micro-batch position_ids and document_ids
    (B, T) (`eagle3_loss`). `drafter` is what checkpoints and final/ hold.
    With feature_noise > 0 the features are noised in training mode only: the trainer's held-out evaluation runs the
    module in eval mode, on the clean features (as speculators noises its training set, not its validation set).
    """

    def __init__(self, drafter: Eagle3Head, steps: int, decay: float, feature_noise: float = 0.0,
                 attention: str = "auto", activation_checkpointing: bool = False):
        super().__init__()
        self.drafter, self.steps, self.decay, self.feature_noise = drafter, steps, decay, feature_noise
        self.attention, self.activation_checkpointing = attention, activation_checkpointing

    def forward(self, input_ids, attention_mask, loss_mask, aux, target: TargetSide, position_ids=None,
                document_ids=None):
        if self.training and self.feature_noise > 0:  # off: nothing is drawn, the step is the one without noise
            aux = add_feature_noise(aux.to(self.drafter.fc.weight.dtype), self.feature_noise)  # in the weights' dtype
        return eagle3_loss(self.drafter, input_ids, attention_mask, loss_mask, aux, target, self.steps, self.decay,
                           position_ids, document_ids, self.attention,
                           activation_checkpointing=self.activation_checkpointing and torch.is_grad_enabled())


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
    return (Eagle3Step(head, cfg.ttt_steps, cfg.ttt_decay, cfg.feature_noise, cfg.attention,
                       cfg.activation_checkpointing),
            target_prepare(head.t2d, target, mode, autocast))


summarize = partial(summarize_steps, columns=STATS)  # metrics and E[tau] from the summed statistics
# the method table's hooks (draftsmith.core.method_hooks)
HOOKS = TrainingHooks(config=Eagle3Config, offline_data=OFFLINE_DATA, new_drafter=new_eagle3, training=eagle3_training,
                      summarize=summarize)


# ---- the check of the memory-efficient attention against the dense one (tests on the CPU; on CUDA the GPU check,
# benchmarks/gpu_train_check.py, where flex has a backward) --------------------------------------------------------

def tiny_eagle3_head(device="cpu", dtype=torch.float64, seed: int = 0, **norms) -> Eagle3Head:
    """A random EAGLE-3 head (hidden 128, 4 query / 2 KV heads of 32, vocab 256, draft vocab 96) with weights that
    look trained (no zero or unit tensor) and a random draft vocab."""
    target_config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=512)
    head = Eagle3Head(eagle3_config_from_target(target_config, 96, **norms))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        used = torch.randperm(256, generator=g)[:96].sort().values  # the draft vocab's target ids
        head.d2t.copy_(used - torch.arange(96))
        head.t2d.zero_()[used] = True
    return head.to(device=device, dtype=dtype)


def random_conversation(head: Eagle3Head, length: int, g: torch.Generator, dtype=torch.float64) -> dict:
    """One conversation's rows (length,) on the CPU: tokens, features, target side; its first quarter a prompt."""
    V, Vd = head.config.vocab_size, head.config.draft_vocab_size
    argmax = torch.randint(0, V, (length,), generator=g)
    return {"input_ids": torch.randint(0, V, (length,), generator=g),
            "loss_mask": (torch.arange(length) >= length // 4).long(),
            "aux": torch.randn(length, head.fc.in_features, generator=g, dtype=dtype),
            "probs": torch.softmax(torch.randn(length, Vd, generator=g, dtype=dtype) * 2, -1),
            "in_mass": torch.rand(length, generator=g, dtype=dtype),
            "argmax": argmax, "argmax_in_draft": head.t2d.cpu()[argmax]}


def pack(conversations: list[dict], rows: list[list[int]], T: int, device="cpu", documents: bool = True) -> dict:
    """A micro-batch (B = len(rows), T): row r holds conversations rows[r] one after the other, then padding
    (attention_mask 0, a document id of its own). documents=False: one conversation per row, no position_ids or
    document_ids (each row then must hold one). Returns Eagle3Step.forward's keyword arguments."""
    B = len(rows)
    first = conversations[0]
    out = {"input_ids": torch.zeros(B, T, dtype=torch.long), "attention_mask": torch.zeros(B, T, dtype=torch.long),
           "loss_mask": torch.zeros(B, T, dtype=torch.long), "position_ids": torch.zeros(B, T, dtype=torch.long),
           "document_ids": torch.zeros(B, T, dtype=torch.long),
           "aux": first["aux"].new_zeros(B, T, first["aux"].shape[-1])}
    side = {name: first[name].new_zeros(B, T, *first[name].shape[1:])
            for name in ("probs", "in_mass", "argmax", "argmax_in_draft")}
    for r, members in enumerate(rows):
        at = 0
        for d, c in enumerate(members):
            n = conversations[c]["input_ids"].shape[0]
            for name in ("input_ids", "loss_mask", "aux"):
                out[name][r, at:at + n] = conversations[c][name]
            for name in side:
                side[name][r, at:at + n] = conversations[c][name]
            out["attention_mask"][r, at:at + n] = 1
            out["position_ids"][r, at:at + n] = torch.arange(n)
            out["document_ids"][r, at:at + n] = d
            at += n
        out["document_ids"][r, at:] = len(members)
    if not documents:
        del out["position_ids"], out["document_ids"]
    out = {name: x.to(device) for name, x in out.items()}
    out["target"] = TargetSide(**{name: x.to(device) for name, x in side.items()})
    return out


def check_attention_against_dense(device="cpu", dtype=torch.float32, grads: bool = True,
                                  activation_checkpointing: bool = False, *, steps: int, scale: int = 1,
                                  **options) -> dict:
    """The EAGLE-3 step of `steps` TTT steps with method.attention=flex against dense on one packed micro-batch (2
    rows of T = 30 * scale, 5 conversations, padding, prompts; scale >= 5 spans several of flex's 128-token blocks):
    the largest absolute differences of the loss, the statistics and (grads=True: flex has no CPU backward, so on
    CUDA only) every gradient, and the largest gradient for scale. options: eagle3_loss's (sync_free, ...). Float64
    on the CPU agrees to ~1e-15; float32 on CUDA to float32 rounding."""
    device = torch.device(device)
    head = tiny_eagle3_head(device, dtype)
    g = torch.Generator().manual_seed(1)
    conversations = [random_conversation(head, n * scale, g, dtype) for n in (9, 14, 5, 11, 7)]
    batch = pack(conversations, [[0, 1], [2, 3, 4]], 30 * scale, device)
    results = []
    for attention in ("dense", "flex"):
        head.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grads):
            loss, stats = eagle3_loss(head, **batch, steps=steps, attention=attention,
                                      activation_checkpointing=activation_checkpointing, **options)
        if grads:
            loss.backward()
        results.append((loss.detach(), stats, {n: p.grad.clone() for n, p in head.named_parameters()
                                               if p.grad is not None}))
    (loss_d, stats_d, grads_d), (loss_f, stats_f, grads_f) = results
    assert grads_d.keys() == grads_f.keys()
    return {"loss": float((loss_d - loss_f).abs()), "stats": float((stats_d - stats_f).abs().max()),
            "grad": max((float((grads_d[n] - grads_f[n]).abs().max()) for n in grads_d), default=0.0),
            "grad_scale": max((float(grads_d[n].abs().max()) for n in grads_d), default=0.0)}
