"""The draft vocabulary map between draft ids and target ids.

The draft vocab is the `draft_vocab_size` most frequent loss-masked (assistant) target tokens,
sorted ascending. Engines read two tensors:
  d2t (draft_vocab,) int64: target_id = draft_id + d2t[draft_id]
  t2d (target_vocab,) bool: t2d[target_id] is True iff target_id is in the draft vocab
Built once from the training data and stored in the checkpoint; never rebuilt on resume.
"""

from __future__ import annotations

import torch

from ..core import DraftsmithError


def count_tokens(input_ids_rows, loss_mask_rows, vocab_size: int) -> torch.Tensor:
    """Counts (vocab_size,) int64 of target tokens where loss_mask is 1."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in zip(input_ids_rows, loss_mask_rows):
        ids = torch.as_tensor(ids, dtype=torch.long)
        mask = torch.as_tensor(mask, dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from per-target-token counts.

    The most frequent tokens win (ties: lower id first); when fewer tokens were seen than
    `draft_vocab_size`, the rest of the draft vocab is filled with the lowest unseen ids so the
    shape the engines expect is kept.
    """
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise DraftsmithError(f"draft_vocab_size={draft_vocab_size} must be in 1..{vocab_size} (the target's vocab).")
    # Stable sort on -count keeps lower ids first among equal counts.
    order = torch.sort(-counts.to(torch.long), stable=True).indices
    used = torch.sort(order[:draft_vocab_size]).values
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def draft_vocab_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target ids of the draft vocab, ascending: i + d2t[i]."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t
