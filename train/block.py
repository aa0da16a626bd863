"""What the block drafters' training shares (train/dflash.py, train/dspark.py): the anchors and the batched block
forward of the training layout (train/dflash.py's docstring states it: the block at anchor a is [x_a, mask, ...] at
positions a .. a+bs-1 over the context c_t of every real t < a)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..heads.block import DFlashHead
from .features import target_prepare


def sample_anchors(valid: torch.Tensor, max_anchors: int,
                   generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor (B, n) long, real (B, n) bool): up to `max_anchors` anchors per row among the positions a >= 1
    whose first slot's target counts (valid (B, T) = loss_mask & attention_mask), sorted; padding anchors are 0."""
    valid = valid.bool().cpu()
    rows = []
    for b in range(valid.shape[0]):
        candidates = torch.nonzero(valid[b, 1:]).squeeze(1) + 1
        pick = torch.randperm(candidates.numel(), generator=generator)[:max_anchors]
        rows.append(candidates[pick].sort().values)
    n = max(max(r.numel() for r in rows), 1)
    anchor = torch.zeros(valid.shape[0], n, dtype=torch.long)
    real = torch.zeros(valid.shape[0], n, dtype=torch.bool)
    for b, r in enumerate(rows):
        anchor[b, : r.numel()], real[b, : r.numel()] = r, True
    return anchor, real


def block_inputs(head: DFlashHead, input_ids: torch.Tensor, anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, n*bs), positions (B, n*bs)) of every block: [x_a, mask, ...] at a, a+1, ..., a+bs-1."""
    bs = head.block_size
    offset = torch.arange(bs, device=anchor.device)
    positions = (anchor[:, :, None] + offset).flatten(1)  # (B, n*bs)
    tokens = torch.full_like(positions, head.mask_token_id)
    tokens[:, ::bs] = torch.gather(input_ids, 1, anchor)
    return tokens, positions


def block_forward(head: DFlashHead, input_ids: torch.Tensor, aux: torch.Tensor, anchor: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """Pre-norm hidden (B, n*bs, H) of every block in one forward; mask (B, 1, n*bs, T + n*bs) over [context;
    blocks] (`block_mask` builds the right one; tests pass broken ones)."""
    B, T = input_ids.shape
    tokens, positions = block_inputs(head, input_ids, anchor)
    ctx_pos = torch.arange(T, device=input_ids.device)[None].expand(B, -1)
    return head.trunk(tokens, positions, head.context(aux), ctx_pos, mask)


def counted_slots(anchor: torch.Tensor, real: torch.Tensor, valid: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counted (B, n, bs) bool, u (B, n, bs) long): slot (a, k) is trained on the target's distribution at u = a+k-1
    (it drafts x_{a+k}); it counts when its block is real, k >= 1 (slot 0 is the bonus token, never drafted),
    u <= T-1 and valid[u] (valid (B, T) = loss_mask & attention_mask). u is clamped into the row."""
    T = valid.shape[1]
    u = anchor[:, :, None] + torch.arange(block_size, device=anchor.device) - 1  # (B, n, bs)
    counted = real[:, :, None] & (u >= anchor[:, :, None]) & (u <= T - 1)  # slot 0 (u = a-1) never counts
    u = u.clamp(0, T - 1)
    return counted & torch.gather(valid.bool(), 1, u.flatten(1)).view_as(u), u


def slot_stats(counted: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor], loss: torch.Tensor,
               in_loss: torch.Tensor, correct: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """The STEP_STATS + CHAIN_STATS sums (train/stats.py) of the counted slots, one row per block position 1 .. bs-1:
    `slots` = (b, j, k) (M,) each of the counted slots (torch.nonzero(counted)), and per slot its loss (M,) (0 where
    it is not in the loss), in_loss (M,) bool (the target's argmax is in the draft vocab), correct (M,) bool (the
    draft's argmax is the target's) and alpha (M,) (the acceptance probability sum_v min(p_v, q_v))."""
    b_i, j_i, k_i = slots
    bs = counted.shape[-1]
    one_hot = F.one_hot(k_i - 1, bs - 1).to(loss.dtype)  # (M, bs-1): row k-1 = block position k
    # chain columns: slot k of a block counts when slots 1..k all count; its value is the product over them
    grid = torch.zeros(counted.shape, dtype=loss.dtype, device=loss.device)  # (B, n, bs)
    corr_grid = grid.index_put((b_i, j_i, k_i), correct.to(loss.dtype))[..., 1:]
    alpha_grid = grid.index_put((b_i, j_i, k_i), alpha.to(loss.dtype))[..., 1:]
    run = torch.cumprod(counted[..., 1:].to(loss.dtype), dim=-1)  # (B, n, bs-1) 1 while every slot so far counts
    chain_correct = (torch.cumprod(corr_grid, -1) * run).sum((0, 1))
    chain_alpha = (torch.cumprod(alpha_grid, -1) * run).sum((0, 1))
    return torch.stack([one_hot.T @ loss, one_hot.T @ in_loss.to(loss.dtype), one_hot.T @ correct.to(loss.dtype),
                        one_hot.T @ alpha.to(loss.dtype), one_hot.sum(0), one_hot.T @ (~in_loss).to(loss.dtype),
                        chain_correct, chain_alpha, run.sum((0, 1))], dim=1)


def block_prepare(t2d: torch.Tensor, target, mode: str, autocast: Callable, max_anchors: int) -> Callable[[dict], dict]:
    """`prepare(batch)` of a block drafter (DFlash, DSpark): the target side under no_grad (as EAGLE-3's), then the
    anchors drawn with torch's CPU generator (restored on resume, so resume stays exact)."""
    target_side = target_prepare(t2d, target, mode, autocast)

    def prepare(batch: dict) -> dict:
        batch = target_side(batch)
        valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        anchor, real = sample_anchors(valid, max_anchors)
        device = batch["input_ids"].device
        return {**batch, "anchor": anchor.to(device), "real": real.to(device)}

    return prepare
