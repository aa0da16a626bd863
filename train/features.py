"""What feature-fed training steps read of the target, shared by the methods (EAGLE-3, P-EAGLE): the target's
distributions over the draft vocab (`TargetHead` -> `TargetSide`), the `prepare(batch)` that adds them and the
features, and the draft vocab map (built once from the training rows, or the checkpoint's on resume)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from safetensors.torch import load_file

from ..heads.vocab import build_vocab_map, count_tokens


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
    the full-vocab argmax and normaliser, so no full-vocab tensor survives this call. When data-gen
    stored those two per position (`top`, `lse`: data_gen/capture.py), the rest is not multiplied at all.
    """

    def __init__(self, lm_head_weight: torch.Tensor, t2d: torch.Tensor):
        t2d = t2d.to(lm_head_weight.device)
        self.draft_ids = torch.nonzero(t2d).squeeze(1)  # (Vd,) target ids, ascending
        self.rest_ids = torch.nonzero(~t2d).squeeze(1)
        self.w_draft = lm_head_weight[self.draft_ids].detach()  # (Vd, H)
        self.w_rest = lm_head_weight[self.rest_ids].detach()  # (V - Vd, H)

    @torch.no_grad()
    def __call__(self, last_hidden: torch.Tensor, rows: Optional[torch.Tensor] = None,
                 top: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                 sync_free: Optional[bool] = None) -> TargetSide:
        """last_hidden (B, T, H): the target's post-final-norm hidden state. `rows` (B, T) bool: compute only
        these positions (the losses read no other); the others are left zero (argmax 0, not in the draft vocab).
        top / lse (B, T): the target's full-vocab argmax and logsumexp, when stored. sync_free (default: off a
        CPU) computes `rows` without a host sync."""
        if sync_free is None:
            sync_free = last_hidden.device.type != "cpu"
        if rows is not None and sync_free:
            # On an accelerator a boolean gather is a host sync (its size is data-dependent): every position is
            # computed and the others zeroed instead, the same values without a stall (on a CPU the gather saves work)
            full = self(last_hidden, None, top, lse)
            return TargetSide(torch.where(rows[..., None], full.probs, 0), torch.where(rows, full.in_mass, 0),
                              torch.where(rows, full.argmax, 0), full.argmax_in_draft & rows)
        if rows is not None:
            if top is not None:
                assert lse is not None  # stored with top
                part = self(last_hidden[rows], None, top[rows], lse[rows])
            else:
                part = self(last_hidden[rows], None)
            B, T = rows.shape
            probs = part.probs.new_zeros(B, T, part.probs.shape[-1])
            in_mass, argmax = part.in_mass.new_zeros(B, T), part.argmax.new_zeros(B, T)
            in_draft = part.argmax_in_draft.new_zeros(B, T)
            probs[rows], in_mass[rows], argmax[rows], in_draft[rows] = (part.probs, part.in_mass, part.argmax,
                                                                         part.argmax_in_draft)
            return TargetSide(probs, in_mass, argmax, in_draft)
        x = last_hidden.to(self.w_draft.dtype)
        draft_logits = (x @ self.w_draft.T).float()  # (B, T, Vd)
        lse_draft = torch.logsumexp(draft_logits, dim=-1)
        probs = torch.softmax(draft_logits, dim=-1)
        if top is not None:  # stored: from the unrounded hidden state, so the draft part's mass is capped at 1
            assert lse is not None  # stored with top
            in_draft = torch.isin(top, self.draft_ids)
            return TargetSide(probs, torch.exp(lse_draft - lse.float()).clamp(max=1.0), top.long(), in_draft)
        best_draft, best_draft_i = draft_logits.max(dim=-1)
        if self.rest_ids.numel():
            rest_logits = (x @ self.w_rest.T).float()  # (B, T, V - Vd)
            lse_full = torch.logaddexp(lse_draft, torch.logsumexp(rest_logits, dim=-1))
            best_rest, best_rest_i = rest_logits.max(dim=-1)
            in_draft = best_draft >= best_rest
            argmax = torch.where(in_draft, self.draft_ids[best_draft_i], self.rest_ids[best_rest_i])
        else:
            lse_full, in_draft, argmax = lse_draft, torch.ones_like(lse_draft, dtype=torch.bool), self.draft_ids[best_draft_i]
        return TargetSide(probs, torch.exp(lse_draft - lse_full), argmax, in_draft)


def vocab_map_for(target, draft_vocab_size: int, train, resume: Optional[Path]) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d): from the training rows' assistant tokens, or on resume the checkpoint's (never rebuilt)."""
    if resume is not None:
        saved = load_file(str(resume / "head.safetensors"))
        return saved["d2t"], saved["t2d"]
    rows = train.indices  # rows are read-only views of the memory-mapped tokens: counted from copies
    counts = count_tokens((np.array(train.input_ids[i]) for i in rows), (np.array(train.loss_mask[i]) for i in rows),
                          target.vocab_size)
    return build_vocab_map(counts, min(draft_vocab_size, target.vocab_size))


def target_features(target, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux (B, T, 3H), last (B, T, H)): the target run on the batch. A packed batch (position_ids, train/data.py
    pack_rows) runs with its position_ids and no 2-D mask: transformers' masking_utils then reads the documents
    from where the positions restart (find_packed_sequence_indices) and keeps each one's causal attention inside
    it, so every conversation sees what it would alone (rotary positions from 0, no token of another). Padding
    sits at the row's end, where no real token attends."""
    if "position_ids" not in batch:
        return target.features(batch["input_ids"], batch["attention_mask"])
    out = target.model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                             output_hidden_states=True, use_cache=False)
    hs = out.hidden_states  # N+1 tensors (B, T, H); [0] = embeddings, [N] = after the final norm
    return torch.cat([hs[i] for i in target.aux_layer_ids], dim=-1), hs[-1]


def target_prepare(t2d: torch.Tensor, target, mode: str, autocast: Callable) -> Callable[[dict], dict]:
    """`prepare(batch)` adding `aux` (online: the target runs; offline: the batch's) and the TargetSide over
    the draft vocab `t2d`; shared by the methods that read the target's features."""
    target_head = TargetHead(target.model.get_output_embeddings().weight, t2d)
    features = partial(target_features, target) if mode == "online" else None  # offline keeps only target_head

    def prepare(batch: dict) -> dict:
        with torch.no_grad():
            if features is not None:
                with autocast():
                    aux, last = features(batch)
            else:
                aux, last = batch.pop("aux"), batch.pop("last")
            batch.pop("last", None)
            stored = (batch.pop("target_top", None), batch.pop("target_lse", None))  # offline, when data-gen stored them
            # (online batches carry neither: (None, None) = recompute from the full lm_head)
            counted = batch["loss_mask"].bool() & batch["attention_mask"].bool()  # the only positions a loss reads
            return {**batch, "aux": aux, "target": target_head(last, counted, *stored)}

    return prepare
