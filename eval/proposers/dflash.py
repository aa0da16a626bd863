"""The DFlash proposer: K draft tokens from ONE drafter forward per cycle (a chain), as vLLM's DFlashProposer.

After the target verified and emitted tokens, the sequence is x_0 .. x_{L-1}; the target's features are known
for positions up to L-2 and x_{L-1} (the bonus / correction token) is the root of the next draft. One forward runs

    context   the features of the positions verified since the last cycle (start .. L-2): keys / values only,
              written to the drafter's cache at slot = position, once
    queries   [x_{L-1}, mask, ..., mask] at positions L-1 .. L-1+K       (cache slots L-1 .. L-1+K)

and every query sees every slot in use (0 .. L-1+K: the whole context and the whole block, no causal mask;
heads/dflash.py). The mask query at position L-1+k drafts x_{L-1+k}. The query slots are overwritten by the
next cycle's context, and nothing past the slots in use is ever read.

The k mask rows are drafted as one chain by the shared kit (eval/proposers/kit.py `OneForwardProposer`,
`sample_chain`): a row's q does not depend on the tokens drafted before it, so the decoder's rejection rule
stays exact. Tree mode drafts the same chain.
"""

from __future__ import annotations

import torch

from draftsmith.core import DraftsmithError
from draftsmith.eval.proposers.kit import OneForwardProposer
from draftsmith.heads.dflash import DFlashHead


class DFlashProposer(OneForwardProposer):
    def __init__(self, head: DFlashHead, target_vocab_size: int, max_len: int):
        super().__init__(head, target_vocab_size, max_len, "DFlash")

    def _check_k(self, k: int) -> None:
        """Mask slots past the trained block were never trained: refuse, do not guess."""
        if k > self.head.block_size - 1:
            raise DraftsmithError(f"K={k} (drafting.num_speculative_tokens or sweep_k) is more than the "
                                  f"{self.head.block_size - 1} tokens a block of this DFlash head drafts (block_size "
                                  f"{self.head.block_size} in its config.json); draft at most "
                                  f"{self.head.block_size - 1}, or train with method.block_size={k + 1}.")

    def _forward(self, k: int) -> torch.Tensor:
        """Write the pending context and run the block [x_{L-1}, k masks] in one forward; its k mask rows' logits."""
        L, T, start = self._pending_span()  # the pending rows are positions [start, L-1)
        width = self._slots_in_use(L + k)  # context 0 .. L-2, the block L-1 .. L-1+k
        ids = torch.tensor([self.seq[-1]] + [self.head.mask_token_id] * k, device=self.device)[None]  # (1, k+1)
        block_pos = torch.arange(L - 1, width, device=self.device)  # (k+1,)
        context = self.head.context(self.pending[None].to(self.device)) if T else None  # (1, T, H)
        ctx_pos = torch.arange(start, L - 1, device=self.device)  # (T,)
        mask = torch.ones(1, 1, k + 1, width, dtype=torch.bool, device=self.device)  # every slot in use, both ways
        _, logits = self.head(ids, block_pos[None], context, ctx_pos[None] if T else None, mask, self.caches,
                              torch.cat([ctx_pos, block_pos]) if T else block_pos)
        self.pending = self.pending[:0]  # the context now sits in the cache
        return logits[0, 1:]  # the mask rows


def proposer(head: DFlashHead, target_vocab_size: int, max_len: int) -> DFlashProposer:
    """The method table's hook: the decoder's proposer for a DFlash drafter."""
    return DFlashProposer(head, target_vocab_size, max_len)
