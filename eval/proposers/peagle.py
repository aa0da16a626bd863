"""The P-EAGLE proposer: K draft tokens from ONE drafter forward per cycle (a chain).

After the target verified and emitted tokens, the sequence is x_0 .. x_{L-1}; the target's features are known
for positions up to L-2. One forward runs

    the new depth-0 entries   position p (start .. L-2): token x_{p+1}, hidden fc(f_p)        (cache slot p)
    K-1 mask slots            position L-2+d (d = 1 .. K-1): mask token, fc(mask_hidden)  (cache slot L-2+d)

causally over the cache slots in use (heads/peagle.py: the training layout's mask rule for one anchor). The
logits of entry L-2 draft x_L, those of mask slot d draft x_{L+d}. Entries stay in the cache (one per
position, written once); the mask slots are overwritten by the next cycle's entries, and nothing past the
slots in use is ever read.

The K rows are drafted as one chain by the shared kit (eval/proposers/kit.py `OneForwardProposer`,
`sample_chain`): depth d's q does not depend on the tokens drafted before it, so the decoder's rejection rule
stays exact. Tree mode drafts the same chain.
"""

from __future__ import annotations

import torch

from ...core import DraftsmithError
from .kit import OneForwardProposer
from ...heads.peagle import PEagleHead


class PEagleProposer(OneForwardProposer):
    def __init__(self, head: PEagleHead, target_vocab_size: int, max_len: int):
        super().__init__(head, target_vocab_size, max_len, "P-EAGLE")
        with torch.inference_mode():
            self.mask_fused = head.mask_fused()  # (H,) every cycle's mask slots read it

    def _check_num_speculative_tokens(self, num_speculative_tokens: int) -> None:
        """Deeper mask slots than the trained depths were never trained: refuse, do not guess."""
        depths = getattr(self.head.config, "num_depths", None)
        if depths is not None and num_speculative_tokens > depths:
            raise DraftsmithError(f"K={num_speculative_tokens} (drafting.num_speculative_tokens or sweep_k) is more "
                                  f"than the {depths} depths this P-EAGLE head was trained for (num_depths in its "
                                  f"config.json); draft at most {depths} tokens, or train with method.depths={num_speculative_tokens}.")

    def _forward(self, num_speculative_tokens: int) -> torch.Tensor:
        """Run the pending entries and K-1 mask slots in one forward; the K rows of draft logits."""
        L, T, start = self._pending_span()  # the pending rows are positions [start, L-1)
        width = self._slots_in_use(L - 1 + num_speculative_tokens - 1)  # entries 0 .. L-2, mask slots L-1 .. L+K-3
        ids = torch.tensor(self.seq[start + 1:] + [self.head.mask_token_id] * (num_speculative_tokens - 1),
                           device=self.device)[None]
        fused = self.head.fuse(self._pending_rows()[None].to(self.device))  # (1, T, H)
        masks = self.mask_fused.to(fused.dtype).expand(1, num_speculative_tokens - 1, -1)  # (1, K-1, H)
        hidden = torch.cat([fused, masks], dim=1)  # (1, T+K-1, H)
        pos = torch.arange(start, width, device=self.device)  # slot == position
        mask = (torch.arange(width, device=self.device)[None, :] <= pos[:, None])[None, None]  # (1, 1, N, width)
        _, logits = self.head(ids, hidden, pos[None], mask, self.caches, pos)
        self.pending = self._pending_rows()[:0]  # the entries now sit in the cache
        return logits[0, T - 1:]  # the last entry and the mask slots


def proposer(head: PEagleHead, target_vocab_size: int, max_len: int) -> PEagleProposer:
    """The method table's hook: the decoder's proposer for a P-EAGLE head."""
    return PEagleProposer(head, target_vocab_size, max_len)
