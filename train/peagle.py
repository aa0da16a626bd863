"""The P-EAGLE training step: depth sampling, the batched parallel forward, the loss.

Conventions (index t of a sequence x_0 .. x_{T-1}; f_t = the target's fused features at position t):

    slot (t, 0):  token x_{t+1},     hidden fc(f_t),         position t       (EAGLE-3's step 0)
    slot (t, d):  token mask_id,     hidden fc(mask_hidden), position t + d   (d = 1 .. depths-1)
    target of slot (t, d): softmax(target logits at position t+1+d) over the draft vocab (t2d rows,
                           renormalised): slot (t, d) drafts x_{t+2+d}
    valid (t, d):  t+1+d < T, loss_mask and attention_mask set at t+1+d

Depth sampling (`sample_slots`, the COD sampling of vLLM's speculators P-EAGLE trainer): every index keeps
its depth-0 slot; depth d >= 1 keeps floor(max(r^d, r_min) * n_d) groups, n_d = the indices whose depth-d
target is valid, drawn among the groups that reached depth d-1 and whose depth-d target is valid (so a group
is always depths 0..D of one anchor, as at inference). The slots of one sequence are laid out [all depth-0 |
depth 1 | depth 2 | ...] and the rows of a micro-batch padded to the longest.

Attention (`heads.peagle.slot_mask`): a slot sees the depth-0 slots of real tokens at or before its anchor
and its own group's earlier depths. So slot (t, d) computes exactly what the drafter computes at inference
after position t+1 is known: a causal forward over the prefix plus d mask slots (tests/test_train_peagle.py
checks this against per-group forwards).

Loss: soft cross-entropy (target probs, draft log-probs) over every valid slot whose target argmax is in the
draft vocab, averaged over those slots; `depth_decay`^d weights depth d (1.0, no decay, by default).
Logged per depth d: loss, accuracy and expected acceptance alpha_d = sum_v min(p_v, q_v), as EAGLE-3 logs
them per TTT step (train/stats.py's step columns and summary; no chain columns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..core import DraftsmithError, checks
from ..core.method_hooks import TrainingHooks
from ..heads.peagle import PEagleHead, peagle_config_from_target, slot_mask
from .features import TargetSide, target_prepare, vocab_map_for
from .stats import STEP_STATS, summarize_steps

# Columns of the per-depth statistics tensor `peagle_loss` returns (train/stats.py): no chain columns, as the slots
# of one anchor are sampled, not all there.
STATS = STEP_STATS
OFFLINE_DATA = "hidden_states"  # what mode=offline reads from a data-gen folder: the target's features


@dataclass
class PEagleConfig:
    """`method=peagle`: the options of P-EAGLE training (configs/method/peagle.yaml).

    Defaults of depth sampling are those of vLLM's speculators P-EAGLE trainer (r = 0.7, r_min = 0.2, 8 depths)."""

    name: str = "peagle"  # the method (set by method=peagle)
    draft_vocab_size: int = 32000  # the most frequent assistant tokens; capped at the target's vocab
    num_layers: int = 4  # decoder layers of the drafter (the first is EAGLE-3's, fed by the fused features)
    depths: int = 8  # K: depths trained (slot 0 and K-1 mask slots); eval may draft up to this many tokens
    down_sample_ratio: float = 0.7  # r: depth d keeps a fraction max(r^d, r_min) of the positions
    down_sample_ratio_min: float = 0.2  # r_min
    depth_decay: float = 1.0  # loss weight of depth d is depth_decay**d (1.0: none, as published)
    mask_token_id: Optional[int] = None  # token id of the mask slots; None = the target's last vocab id
    train_embeddings: bool = True  # the published P-EAGLE recipes train them; false keeps the target's frozen

    def __post_init__(self):
        checks.one_of("method.name", self.name, ("peagle",))
        checks.at_least("method.draft_vocab_size", self.draft_vocab_size, 1)
        checks.at_least("method.num_layers", self.num_layers, 1)
        checks.at_least("method.depths", self.depths, 1)
        checks.in_range("method.down_sample_ratio", self.down_sample_ratio, 0, 1, low_open=True)
        checks.in_range("method.down_sample_ratio_min", self.down_sample_ratio_min, 0, 1, low_open=True)
        checks.positive("method.depth_decay", self.depth_decay)
        if self.mask_token_id is not None:
            checks.at_least("method.mask_token_id", self.mask_token_id, 0)


# ---- depth sampling -------------------------------------------------------------------------------

@dataclass
class Slots:
    """The slot layout of a micro-batch: row b holds its T depth-0 slots, then its sampled deeper slots."""

    anchor: torch.Tensor  # (B, N) long: the index t of the slot's group (0 for padding slots)
    depth: torch.Tensor  # (B, N) long
    real: torch.Tensor  # (B, N) bool: False for the padding that evens the rows out

    def to(self, device) -> "Slots":
        return Slots(self.anchor.to(device), self.depth.to(device), self.real.to(device))


def depth_ratio(d: int, r: float, r_min: float) -> float:
    return max(r ** d, r_min)


def sample_slots(valid: torch.Tensor, depths: int, r: float, r_min: float,
                 generator: Optional[torch.Generator] = None) -> Slots:
    """Draw the groups of every depth (module docstring); valid (B, T) bool = loss_mask & attention_mask."""
    valid = valid.bool().cpu()
    B, T = valid.shape
    rows = []
    for b in range(B):
        anchors, levels = [torch.arange(T)], [torch.zeros(T, dtype=torch.long)]
        reached = torch.arange(T)  # the groups that reached depth d-1
        for d in range(1, depths):
            ok = torch.zeros(T, dtype=torch.bool)
            ok[: max(T - 1 - d, 0)] = valid[b, 1 + d:]  # index t's depth-d target (position t+1+d) is valid
            candidates = reached[ok[reached]]
            n = min(math.floor(depth_ratio(d, r, r_min) * int(ok.sum())), candidates.numel())
            if n <= 0:
                break
            pick = torch.randperm(candidates.numel(), generator=generator)[:n]
            reached = candidates[pick].sort().values
            anchors.append(reached)
            levels.append(torch.full((n,), d, dtype=torch.long))
        rows.append((torch.cat(anchors), torch.cat(levels)))
    N = max(a.numel() for a, _ in rows)
    anchor = torch.zeros(B, N, dtype=torch.long)
    depth = torch.zeros(B, N, dtype=torch.long)
    real = torch.zeros(B, N, dtype=torch.bool)
    for b, (a, lv) in enumerate(rows):
        anchor[b, : a.numel()], depth[b, : lv.numel()], real[b, : a.numel()] = a, lv, True
    return Slots(anchor, depth, real)


# ---- the batched parallel forward and the loss ---------------------------------------------------------

def slot_inputs(head: PEagleHead, input_ids: torch.Tensor, fused: torch.Tensor, slots: Slots):
    """(tokens (B, N), hidden (B, N, H), positions (B, N)) of every slot; fused (B, T, H) = head.fuse(aux)."""
    next_ids = F.pad(input_ids[:, 1:], (0, 1))  # index t: x_{t+1} (0 past the end)
    deep = slots.depth > 0  # (B, N)
    tokens = torch.where(deep, head.mask_token_id, torch.gather(next_ids, 1, slots.anchor))
    real_hidden = torch.gather(fused, 1, slots.anchor[..., None].expand(-1, -1, fused.shape[-1]))  # (B, N, H)
    hidden = torch.where(deep[..., None], head.mask_fused().to(fused.dtype), real_hidden)
    return tokens, hidden, slots.anchor + slots.depth


def parallel_forward(head: PEagleHead, input_ids: torch.Tensor, attention_mask: torch.Tensor, aux: torch.Tensor,
                     slots: Slots) -> torch.Tensor:
    """Pre-norm hidden (B, N, H) of every slot, all depths in one forward."""
    tokens, hidden, positions = slot_inputs(head, input_ids, head.fuse(aux), slots)
    mask = slot_mask(slots.anchor, slots.depth, slots.real, attention_mask.bool())
    return head.trunk(tokens, hidden, positions, mask)


def peagle_loss(head: PEagleHead, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                aux: torch.Tensor, target: TargetSide, slots: Slots, depths: int,
                decay: float = PEagleConfig.depth_decay) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of one micro-batch and its statistics (depths, len(STATS)) for logging."""
    B, T = input_ids.shape
    h = parallel_forward(head, input_ids, attention_mask, aux, slots)  # (B, N, H)
    valid = loss_mask.bool() & attention_mask.bool()
    pos = slots.anchor + 1 + slots.depth  # (B, N) the target position of each slot
    inside = slots.real & (pos < T)
    pos = pos.clamp(max=T - 1)
    scored = inside & torch.gather(valid, 1, pos)  # (B, N): slots whose target counts for the metrics
    b_idx, n_idx = torch.nonzero(scored, as_tuple=True)  # (M,) the scored slots only: logits of no others
    t_idx, d_idx = pos[b_idx, n_idx], slots.depth[b_idx, n_idx]
    q_logits = head.logits(h[b_idx, n_idx]).float()  # (M, Vd)
    p = target.probs[b_idx, t_idx]  # (M, Vd)
    in_loss = target.argmax_in_draft[b_idx, t_idx]  # (M,)
    ce = F.cross_entropy(q_logits, p, reduction="none")  # (M,)
    weight = decay ** d_idx.to(ce.dtype)
    loss = (ce * weight * in_loss).sum() / in_loss.sum().clamp(min=1)
    with torch.no_grad():
        q = torch.softmax(q_logits, dim=-1)
        correct = head.draft_to_target(q_logits.argmax(dim=-1)) == target.argmax[b_idx, t_idx]
        alpha = torch.minimum(q, p * target.in_mass[b_idx, t_idx, None]).sum(-1)  # (M,)
        one_hot = F.one_hot(d_idx, depths).to(ce.dtype)  # (M, depths)
        stats = torch.stack([one_hot.T @ (ce.detach() * in_loss), one_hot.T @ in_loss.to(ce.dtype),
                             one_hot.T @ correct.to(ce.dtype), one_hot.T @ alpha, one_hot.sum(0),
                             one_hot.T @ (~in_loss).to(ce.dtype)], dim=1)
    return loss, stats  # stats columns: STATS, one row per depth


class PEagleStep(nn.Module):
    """The trainable module the trainer wraps: the drafter plus its loss (the target stays outside).

    forward(batch) -> (loss, stats); `prepare` adds aux, the TargetSide and the sampled `slots`."""

    def __init__(self, drafter: PEagleHead, depths: int, decay: float):
        super().__init__()
        self.drafter, self.depths, self.decay = drafter, depths, decay

    def forward(self, input_ids, attention_mask, loss_mask, aux, target: TargetSide, slots: Slots):
        return peagle_loss(self.drafter, input_ids, attention_mask, loss_mask, aux, target, slots, self.depths,
                           self.decay)


# ---- the method table's entry points (draftsmith.core.methods) ----------------------------------------

def new_peagle(target, cfg: PEagleConfig, train, resume: Optional[Path]) -> PEagleHead:
    """A drafter for `target`: the vocab map as EAGLE-3 builds it (on resume: the checkpoint's), embeddings and
    lm_head rows copied from the target, `num_layers` layers, the mask token id."""
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else target.vocab_size - 1
    if mask_id >= target.vocab_size:
        raise DraftsmithError(f"method.mask_token_id={mask_id} is outside the target's vocab "
                              f"(0..{target.vocab_size - 1}).")
    d2t, t2d = vocab_map_for(target, cfg.draft_vocab_size, train, resume)
    head = PEagleHead(peagle_config_from_target(target.model.config, d2t.numel(), cfg.num_layers, mask_id,
                                                cfg.train_embeddings, cfg.depths))
    head.init_from_target(target.model, d2t, t2d)
    return head


def peagle_training(head: PEagleHead, target, cfg: PEagleConfig, mode: str,
                    autocast: Callable) -> tuple[PEagleStep, Callable[[dict], dict]]:
    """(the module to train, `prepare(batch)`): prepare adds the target side under no_grad (as EAGLE-3's)
    and draws the depth slots with torch's CPU generator (restored on resume, so resume stays exact)."""
    target_side = target_prepare(head.t2d, target, mode, autocast)

    def prepare(batch: dict) -> dict:
        batch = target_side(batch)
        valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        slots = sample_slots(valid, cfg.depths, cfg.down_sample_ratio, cfg.down_sample_ratio_min)
        return {**batch, "slots": slots.to(batch["input_ids"].device)}

    return PEagleStep(head, cfg.depths, cfg.depth_decay), prepare


summarize = partial(summarize_steps, columns=STATS)  # metrics and E[tau] from the summed statistics
# the method table's hooks (draftsmith.core.method_hooks)
HOOKS = TrainingHooks(config=PEagleConfig, offline_data=OFFLINE_DATA, new_drafter=new_peagle, training=peagle_training,
                      summarize=summarize)
