"""The DFlash proposer: K draft tokens from ONE drafter forward per cycle (a chain), as vLLM's DFlashProposer.

The forward is the block drafter's (eval/proposers/kit.py `BlockProposer`: the context verified since the last cycle
and the block [x_{L-1}, mask, ..., mask] at positions L-1 .. L-1+K, every query seeing every slot in use); the mask
query at position L-1+k drafts x_{L-1+k}.

The K mask rows are drafted as one chain by the shared kit (`OneForwardProposer`, `sample_chain`): a row's q does
not depend on the tokens drafted before it, so the decoder's rejection rule stays exact. Tree mode drafts the same
chain.
"""

from __future__ import annotations

import torch

from .kit import BlockProposer
from ...heads.dflash import DFlashHead


class DFlashProposer(BlockProposer):
    def __init__(self, head: DFlashHead, target_vocab_size: int, max_len: int):
        super().__init__(head, target_vocab_size, max_len, "DFlash")

    def _forward(self, num_speculative_tokens: int) -> torch.Tensor:
        """The K mask rows' logits (K, Vd) of the one block forward."""
        return self.head.logits(self._block(num_speculative_tokens))[1:]


def proposer(head: DFlashHead, target_vocab_size: int, max_len: int) -> DFlashProposer:
    """The method table's hook: the decoder's proposer for a DFlash drafter."""
    return DFlashProposer(head, target_vocab_size, max_len)
