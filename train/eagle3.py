"""The EAGLE-3 training step: target distributions, the training-time-test (TTT) unroll, the loss.

Conventions (index t of a sequence x_0 .. x_{T-1}; f_t = the target's fused features at position t):

    step 0, index t:  token x_{t+1},   hidden fc(f_t),                 position t
    step i, index t:  token x_{t+1+i}, hidden = step i-1's PRE-norm output at t, position t+i
    target at step i, index t: softmax(target logits at position t+1+i) over the draft vocab
                               (t2d rows only, renormalised)
    loss  = sum_i 0.8^i * soft-CE(target probs, draft log-probs), averaged over positions where
            loss_mask[t+1+i] is set, t+1+i < T (inside the real sequence) and the target's argmax
            is in the draft vocab

Attention at step i: query t sees the step-0 keys 0..t and, in each later step j <= i, the key of
its own index t (its own branch one position further on): `ttt_mask(T, i)` over a `ConcatKVCache`.
So index t at step i is exactly what the drafter computes autoregressively after drafting i tokens
from position t (tests/test_train_eagle3.py checks this against a step-by-step decode).

Logged per step i: loss, accuracy (draft argmax mapped to target ids == target argmax) and the
expected acceptance alpha_i = sum_v min(p_v, q_v), p the target's full-vocab probabilities on the
draft tokens, q the draft's. Accuracy and alpha count every loss-masked position, including those
whose target argmax lies outside the draft vocab (which the draft cannot get right).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith import checks
from draftsmith.heads.eagle3 import ConcatKVCache, Eagle3Head, eagle3_config_from_target, ttt_mask


@dataclass
class Eagle3Config:
    """`method=eagle3`: the options of EAGLE-3 training (configs/method/eagle3.yaml).

    The feature layers are the target's (`target.aux_layer_ids`): data-gen captures them too."""

    name: str = "eagle3"  # the method (set by method=eagle3)
    draft_vocab_size: int = 32000  # the most frequent assistant tokens; capped at the target's vocab
    ttt_steps: int = 7  # training-time test: unrolled draft steps per position
    ttt_decay: float = 0.8  # loss weight of TTT step k is ttt_decay**k

    def __post_init__(self):
        checks.one_of("method.name", self.name, ("eagle3",))
        checks.at_least("method.draft_vocab_size", self.draft_vocab_size, 1)
        checks.at_least("method.ttt_steps", self.ttt_steps, 1)
        checks.positive("method.ttt_decay", self.ttt_decay)

# Columns of the per-step statistics tensor `Eagle3Step.forward` returns, summed over positions.
STATS = ("loss_sum", "loss_count", "correct", "alpha_sum", "metric_count")


@dataclass
class TargetSide:
    """What the loss needs from the target, computed once per batch under no_grad."""

    probs: torch.Tensor  # (B, T, Vd) target probabilities over the draft vocab, renormalised
    in_mass: torch.Tensor  # (B, T) the target's full-vocab probability mass on the draft vocab
    argmax: torch.Tensor  # (B, T) the target's argmax (target ids)
    argmax_in_draft: torch.Tensor  # (B, T) bool


class TargetHead:
    """The frozen target lm_head split into draft-vocab rows and the rest (never trained, never wrapped).

    Target logits over the draft vocab come from the draft rows only; the rest is used just for
    the full-vocab argmax and normaliser, so no full-vocab tensor survives this call.
    """

    def __init__(self, lm_head_weight: torch.Tensor, t2d: torch.Tensor):
        t2d = t2d.to(lm_head_weight.device)
        self.draft_ids = torch.nonzero(t2d).squeeze(1)  # (Vd,) target ids, ascending
        self.rest_ids = torch.nonzero(~t2d).squeeze(1)
        self.w_draft = lm_head_weight[self.draft_ids].detach()  # (Vd, H)
        self.w_rest = lm_head_weight[self.rest_ids].detach()  # (V - Vd, H)

    @torch.no_grad()
    def __call__(self, last_hidden: torch.Tensor) -> TargetSide:
        """last_hidden (B, T, H): the target's post-final-norm hidden state."""
        x = last_hidden.to(self.w_draft.dtype)
        draft_logits = (x @ self.w_draft.T).float()  # (B, T, Vd)
        lse_draft = torch.logsumexp(draft_logits, dim=-1)
        best_draft, best_draft_i = draft_logits.max(dim=-1)
        if self.rest_ids.numel():
            rest_logits = (x @ self.w_rest.T).float()  # (B, T, V - Vd)
            lse_full = torch.logaddexp(lse_draft, torch.logsumexp(rest_logits, dim=-1))
            best_rest, best_rest_i = rest_logits.max(dim=-1)
            in_draft = best_draft >= best_rest
            argmax = torch.where(in_draft, self.draft_ids[best_draft_i], self.rest_ids[best_rest_i])
        else:
            lse_full, in_draft, argmax = lse_draft, torch.ones_like(lse_draft, dtype=torch.bool), self.draft_ids[best_draft_i]
        probs = torch.softmax(draft_logits, dim=-1)
        return TargetSide(probs, torch.exp(lse_draft - lse_full), argmax, in_draft)


def ttt_unroll(head: Eagle3Head, input_ids: torch.Tensor, hidden: torch.Tensor,
               attention_mask: torch.Tensor, steps: int):
    """Yield the draft logits (B, T, Vd) of each TTT step; index t of step i drafts x_{t+2+i}.

    input_ids (B, T) right-padded, hidden (B, T, H) = head.fuse(aux), attention_mask (B, T).
    """
    B, T = input_ids.shape
    device = input_ids.device
    cache = ConcatKVCache()
    positions = torch.arange(T, device=device)[None].expand(B, T)
    key_ok = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T) padding keys of step 0
    for i in range(steps):
        tokens = F.pad(input_ids[:, 1 + i:], (0, 1 + i))  # index t: x_{t+1+i} (0 past the end)
        later_keys = torch.ones(B, 1, 1, i * T, dtype=torch.bool, device=device)
        mask = ttt_mask(T, i, device=device) & torch.cat([key_ok, later_keys], dim=-1)  # (B, 1, T, (i+1)T)
        hidden, logits = head(tokens, hidden, positions + i, mask, cache)
        yield logits


def eagle3_loss(head: Eagle3Head, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                loss_mask: torch.Tensor, aux: torch.Tensor, target: TargetSide,
                steps: int = 7, decay: float = 0.8) -> tuple[torch.Tensor, torch.Tensor]:
    """The TTT loss of one micro-batch and its statistics (steps, len(STATS)) for logging."""
    B, T = input_ids.shape
    valid = loss_mask.bool() & attention_mask.bool()  # (B, T): positions whose target counts
    hidden = head.fuse(aux)  # (B, T, H)
    loss = hidden.new_zeros((), dtype=torch.float32)
    stats = []
    for i, logits in enumerate(ttt_unroll(head, input_ids, hidden, attention_mask, steps)):
        k = 1 + i  # index t is scored against the target at position t + k
        n = max(T - k, 0)  # indices whose target lies inside the sequence
        q_logits = logits[:, :n].float()  # (B, n, Vd)
        p = target.probs[:, k:]  # (B, n, Vd)
        m_metric = valid[:, k:]
        m_loss = m_metric & target.argmax_in_draft[:, k:]
        ce = F.cross_entropy(q_logits.reshape(-1, q_logits.shape[-1]), p.reshape(-1, p.shape[-1]),
                             reduction="none").view(B, n)
        n_loss = m_loss.sum()
        loss_i = (ce * m_loss).sum() / n_loss.clamp(min=1)
        loss = loss + decay ** i * loss_i
        with torch.no_grad():
            q = torch.softmax(q_logits, dim=-1)
            draft_top = head.draft_to_target(q_logits.argmax(dim=-1))
            correct = (draft_top == target.argmax[:, k:]) & m_metric
            alpha = torch.minimum(q, p * target.in_mass[:, k:, None]).sum(-1)  # (B, n)
            stats.append(torch.stack([loss_i.detach() * n_loss, n_loss.float(), correct.sum().float(),
                                      (alpha * m_metric).sum(), m_metric.sum().float()]))
    return loss, torch.stack(stats)


class Eagle3Step(nn.Module):
    """The trainable module the trainer wraps: the drafter plus its loss (the target stays outside).

    forward(batch) -> (loss, stats); batch holds input_ids, attention_mask, loss_mask, aux and the
    TargetSide computed by `TargetHead` beforehand. `drafter` is what checkpoints and final/ hold.
    """

    def __init__(self, drafter: Eagle3Head, steps: int, decay: float):
        super().__init__()
        self.drafter, self.steps, self.decay = drafter, steps, decay

    def forward(self, input_ids, attention_mask, loss_mask, aux, target: TargetSide):
        return eagle3_loss(self.drafter, input_ids, attention_mask, loss_mask, aux, target, self.steps, self.decay)


def summarize(stats: torch.Tensor) -> dict:
    """Per-step metrics from summed statistics (steps, len(STATS)) (summed over micro-batches / ranks)."""
    s = stats.double()
    out = {}
    for i in range(s.shape[0]):
        loss_sum, loss_count, correct, alpha_sum, metric_count = s[i].tolist()
        out[f"loss_{i}"] = loss_sum / max(loss_count, 1)
        out[f"acc_{i}"] = correct / max(metric_count, 1)
        out[f"alpha_{i}"] = alpha_sum / max(metric_count, 1)
    return out


# ---- the method table's entry points (draftsmith.methods) ----------------------------------------

def new_eagle3(target, cfg: Eagle3Config, train, resume: Optional[Path]) -> Eagle3Head:
    """A head for `target`: the vocab map from the training rows' assistant tokens (or, on resume,
    from the checkpoint: never rebuilt), embeddings and lm_head rows copied from the target."""
    d2t, t2d = vocab_map_for(target, cfg.draft_vocab_size, train, resume)
    head = Eagle3Head(eagle3_config_from_target(target.model.config, d2t.numel()))
    head.init_from_target(target.model, d2t, t2d)
    return head


def vocab_map_for(target, draft_vocab_size: int, train, resume: Optional[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d): from the training rows' assistant tokens, or on resume the checkpoint's (never rebuilt)."""
    from draftsmith.heads.vocab import build_vocab_map, count_tokens

    if resume is not None:
        from safetensors.torch import load_file

        saved = load_file(str(resume / "head.safetensors"))
        return saved["d2t"], saved["t2d"]
    rows = train.indices
    counts = count_tokens((train.input_ids[i] for i in rows), (train.loss_mask[i] for i in rows), target.vocab_size)
    return build_vocab_map(counts, min(draft_vocab_size, target.vocab_size))


def eagle3_training(head: Eagle3Head, target, cfg: Eagle3Config, mode: str,
                    autocast: Callable) -> tuple[Eagle3Step, Callable[[dict], dict]]:
    """(the module to train, `prepare(batch)`): prepare adds the target side under no_grad:
    features (online: the target runs; offline: the batch carries them) and its distributions."""
    return Eagle3Step(head, cfg.ttt_steps, cfg.ttt_decay), target_prepare(head.t2d, target, mode, autocast)


def target_prepare(t2d: torch.Tensor, target, mode: str, autocast: Callable) -> Callable[[dict], dict]:
    """`prepare(batch)` adding `aux` (online: the target runs; offline: the batch's) and the TargetSide over
    the draft vocab `t2d`; shared by the methods that read the target's features."""
    target_head = TargetHead(target.model.get_output_embeddings().weight, t2d)
    features = target.features if mode == "online" else None  # offline keeps only target_head

    def prepare(batch: dict) -> dict:
        with torch.no_grad():
            if features is not None:
                with autocast():
                    aux, last = features(batch["input_ids"], batch["attention_mask"])
            else:
                aux, last = batch.pop("aux"), batch.pop("last")
            batch.pop("last", None)
            return {**batch, "aux": aux, "target": target_head(last)}

    return prepare
