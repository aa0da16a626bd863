"""The DFlash training step: anchor sampling, the batched block forward, the loss.

Conventions (index t of a sequence x_0 .. x_{T-1}; f_t = the target's fused features at position t;
c_t = hidden_norm(fc(f_t)) the context state; B = block_size):

    block at anchor a (1 <= a <= T-1):  queries (a, k), k = 0 .. B-1
        token   x_a for k = 0 (the bonus token at inference), the mask token for k >= 1
        position a + k
        keys    the context c_t of every real t < a (every layer's k/v projections of c), and the block's own
                queries, without a causal mask (heads/dflash.py `block_mask`)
    target of slot (a, k), k >= 1: softmax(target logits at position u = a+k-1) over the draft vocab (t2d rows,
        renormalised): the slot drafts x_{a+k}; slot 0 is never trained (vLLM never samples it)
    counted (a, k): u <= T-1 and loss_mask & attention_mask at u

So slot (a, k) computes exactly what the drafter computes at inference when x_0 .. x_{a-1} are verified and x_a is
the bonus token (tests/test_train_dflash.py checks this against one forward per block in float64).

Anchors (`sample_anchors`): every a whose first slot counts (valid[a]) is a candidate; each row keeps at most
`max_anchors` of them, drawn uniformly with torch's CPU generator (restored on resume: resume stays exact) and
sorted; shorter rows are padded with blocks that count nothing.

Loss: over the counted slots whose target argmax is in the draft vocab (n of them),

    L = (1/n) * sum w_k * CE_k,   CE_k = -sum_v p_v log q_v  (soft cross-entropy, as every draftsmith method)

with position weights `loss_weighting`:
    exp_decay  w_k = exp(-(k-1)/gamma)                    (DFlash's, gamma = 4 for B = 8 in speculators)
    dpace      D-PACE: with c_k = exp(-CE_k) (no gradient), s_k = (1-alpha) c_k + alpha on counted slots and
               s_k = 1 elsewhere, w_k = m_k * sum_{j >= k} m_j * prod_{i <= j} s_i  (m = counted): the weight
               of log q_k in the gradient of the smoothed expected accepted length sum_j prod_{i <= j} s_i
               (speculators' dpace_loss_decay, alpha = 0.5)
Logged per block position k = 1 .. B-1 (rows 0 .. B-2): loss, accuracy, alpha_k = sum_v min(p_v, q_v) and the
chain columns (every slot of a block drafts from the same anchor), so E[tau] of a block of K = B-1 tokens
comes out of train/stats.py as for EAGLE-3.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..core import DraftsmithError, checks
from ..core.method_hooks import TrainingHooks
from ..heads.dflash import DFlashHead, block_mask, dflash_config_from_target
from .block import block_forward, block_prepare, counted_slots, slot_stats
from .features import TargetSide, vocab_map_for
from .stats import CHAIN_STATS, STEP_STATS, summarize_steps

STATS = STEP_STATS + CHAIN_STATS
OFFLINE_DATA = "hidden_states"  # what mode=offline reads from a data-gen folder: the target's features (its 3 layers)
LOSS_WEIGHTINGS = ("exp_decay", "dpace")


@dataclass
class DFlashConfig:
    """`method=dflash`: the options of DFlash training (configs/method/dflash.yaml).

    The target layers read are the target's (`target.aux_layer_ids`, three), so data-gen's hidden-state shards
    serve offline training."""

    name: str = "dflash"  # the method (set by method=dflash)
    draft_vocab_size: int = 32000  # the most frequent assistant tokens; capped at the target's vocab
    num_layers: int = 4  # decoder layers of the drafter
    block_size: int = 8  # B: a block is the anchor and B-1 mask slots; eval drafts up to B-1 tokens
    max_anchors: int = 64  # blocks per sequence per step (speculators: 512 on a GPU)
    loss_weighting: str = "exp_decay"  # exp_decay | dpace
    gamma: float = 4.0  # exp_decay: w_k = exp(-(k-1)/gamma)
    dpace_alpha: float = 0.5  # dpace: confidence smoothing
    mask_token_id: Optional[int] = None  # token id of the mask slots; None = the target's last vocab id

    def __post_init__(self):
        checks.one_of("method.name", self.name, ("dflash",))
        checks.at_least("method.draft_vocab_size", self.draft_vocab_size, 1)
        checks.at_least("method.num_layers", self.num_layers, 1)
        checks.at_least("method.block_size", self.block_size, 2)
        checks.at_least("method.max_anchors", self.max_anchors, 1)
        checks.one_of("method.loss_weighting", self.loss_weighting, LOSS_WEIGHTINGS)
        checks.positive("method.gamma", self.gamma)
        checks.in_range("method.dpace_alpha", self.dpace_alpha, 0, 1)
        if self.mask_token_id is not None:
            checks.at_least("method.mask_token_id", self.mask_token_id, 0)


def position_weights(ce: torch.Tensor, counted: torch.Tensor, weighting: str, gamma: float,
                     alpha: float) -> torch.Tensor:
    """(B, n, bs) loss weights of the slots (module docstring); ce, counted (B, n, bs), slot 0 uncounted."""
    k = torch.arange(ce.shape[-1], device=ce.device, dtype=ce.dtype)
    if weighting == "exp_decay":
        return torch.exp(-(k - 1).clamp(min=0) / gamma).expand_as(ce) * counted
    m = counted.to(ce.dtype)
    with torch.no_grad():
        s = torch.where(counted, (1 - alpha) * torch.exp(-ce.detach()) + alpha, torch.ones_like(ce))
        prefix = torch.cumprod(s, dim=-1)  # prod_{i <= j} s_i
        suffix = torch.flip(torch.cumsum(torch.flip(prefix * m, [-1]), -1), [-1])  # sum_{j >= k} m_j prefix_j
    return suffix * m


def dflash_loss(head: DFlashHead, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                aux: torch.Tensor, target: TargetSide, anchor: torch.Tensor, real: torch.Tensor, cfg: DFlashConfig,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of one micro-batch and its statistics (block_size-1, len(STATS)) for logging."""
    B = input_ids.shape[0]
    bs = head.block_size
    mask = block_mask(anchor, bs, attention_mask)
    h = block_forward(head, input_ids, aux, anchor, mask).view(B, -1, bs, head.config.hidden_size)  # (B, n, bs, H)
    counted, u = counted_slots(anchor, real, loss_mask.bool() & attention_mask.bool(), bs)
    b_i, j_i, k_i = torch.nonzero(counted, as_tuple=True)  # (M,) the counted slots only: logits of no others
    t_i = u[b_i, j_i, k_i]
    q_logits = head.logits(h[b_i, j_i, k_i]).float()  # (M, Vd)
    p = target.probs[b_i, t_i]  # (M, Vd)
    in_loss = target.argmax_in_draft[b_i, t_i]  # (M,)
    ce = F.cross_entropy(q_logits, p, reduction="none")  # (M,)
    grid = torch.zeros_like(counted, dtype=ce.dtype)
    grid = grid.index_put((b_i, j_i, k_i), ce)  # (B, n, bs) CE of every counted slot, with its gradient
    in_loss_grid = torch.zeros_like(counted).index_put((b_i, j_i, k_i), in_loss)
    weight = position_weights(grid, in_loss_grid, cfg.loss_weighting, cfg.gamma, cfg.dpace_alpha)
    loss = (grid * weight).sum() / in_loss.sum().clamp(min=1)
    with torch.no_grad():
        q = torch.softmax(q_logits, dim=-1)
        correct = head.draft_to_target(q_logits.argmax(dim=-1)) == target.argmax[b_i, t_i]
        alpha = torch.minimum(q, p * target.in_mass[b_i, t_i, None]).sum(-1)  # (M,)
        stats = slot_stats(counted, (b_i, j_i, k_i), ce.detach() * in_loss, in_loss, correct, alpha)
    return loss, stats  # stats columns: STATS, one row per block position 1 .. bs-1


class DFlashStep(nn.Module):
    """The trainable module the trainer wraps: the drafter plus its loss (the target stays outside).

    forward(batch) -> (loss, stats); `prepare` adds aux, the TargetSide and the sampled anchors."""

    def __init__(self, drafter: DFlashHead, cfg: DFlashConfig):
        super().__init__()
        self.drafter, self.cfg = drafter, cfg

    def forward(self, input_ids, attention_mask, loss_mask, aux, target: TargetSide, anchor, real):
        return dflash_loss(self.drafter, input_ids, attention_mask, loss_mask, aux, target, anchor, real, self.cfg)


# ---- the method table's entry points (draftsmith.core.methods) ----------------------------------------

def new_dflash(target, cfg: DFlashConfig, train, resume: Optional[Path]) -> DFlashHead:
    """A drafter for `target`: the vocab map as EAGLE-3 builds it (on resume: the checkpoint's), embeddings and
    lm_head rows copied from the target, `num_layers` layers, the block size, the mask token id and the target's
    three feature layers."""
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else target.vocab_size - 1
    if mask_id >= target.vocab_size:
        raise DraftsmithError(f"method.mask_token_id={mask_id} is outside the target's vocab "
                              f"(0..{target.vocab_size - 1}).")
    if len(target.aux_layer_ids) != 3:
        raise DraftsmithError(f"target.aux_layer_ids={target.aux_layer_ids} names {len(target.aux_layer_ids)} "
                              f"layers; the DFlash drafter reads 3.")
    d2t, t2d = vocab_map_for(target, cfg.draft_vocab_size, train, resume)
    head = DFlashHead(dflash_config_from_target(target.model.config, d2t.numel(), cfg.num_layers, cfg.block_size,
                                                mask_id, target.aux_layer_ids))
    head.init_from_target(target.model, d2t, t2d)
    return head


def dflash_training(head: DFlashHead, target, cfg: DFlashConfig, mode: str,
                    autocast: Callable) -> tuple[DFlashStep, Callable[[dict], dict]]:
    """(the module to train, `prepare(batch)`): prepare adds the target side under no_grad (as EAGLE-3's) and
    draws the anchors with torch's CPU generator (restored on resume, so resume stays exact)."""
    return DFlashStep(head, cfg), block_prepare(head.t2d, target, mode, autocast, cfg.max_anchors)


summarize = partial(summarize_steps, columns=STATS)  # metrics and E[tau] from the summed statistics
# the method table's hooks (draftsmith.core.method_hooks)
HOOKS = TrainingHooks(config=DFlashConfig, offline_data=OFFLINE_DATA, new_drafter=new_dflash, training=dflash_training,
                      summarize=summarize)
