"""The DFlash proposer: K draft tokens from ONE drafter forward per cycle (a chain), as vLLM's DFlashProposer.

After the target verified and emitted tokens, the sequence is x_0 .. x_{L-1}; the target's features are known
for positions up to L-2 and x_{L-1} (the bonus / correction token) is the root of the next draft. One forward runs

    context   the features of the positions verified since the last cycle (start .. L-2): keys / values only,
              written to the drafter's cache at slot = position, once
    queries   [x_{L-1}, mask, ..., mask] at positions L-1 .. L-1+K       (cache slots L-1 .. L-1+K)

and every query sees every slot in use (0 .. L-1+K: the whole context and the whole block, no causal mask;
heads/dflash.py). The mask query at position L-1+k drafts x_{L-1+k}. The query slots are overwritten by the
next cycle's context, and nothing past the slots in use is ever read.

Greedy drafts take each row's argmax; sampled drafts draw each row from its own q (returned, so the decoder's
rejection rule stays exact: a row's q does not depend on the tokens drafted before it). Tree mode drafts the
same chain. With `drafting.stop_below` the chain is cut after its first token whose drafter probability
(greedy: softmax at the argmax; sampling: q(x)) is below the threshold; the forward is already paid, so only
verification width is saved; the kept rows' q are unchanged (lossless).
"""

from __future__ import annotations

from typing import Optional

import torch

from draftsmith.core import DraftsmithError
from draftsmith.eval.decoder import Draft, DraftingConfig
from draftsmith.eval.proposers.kit import eval_head
from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.kit import StaticKVCache
from draftsmith.core.sampling import SamplingConfig, process_logits


class DFlashProposer:
    needs_aux = True

    def __init__(self, head: DFlashHead, target_vocab_size: int, max_len: int):
        cfg = head.config
        self.head, p = eval_head(head, target_vocab_size, "DFlash")
        self.device = p.device
        self.max_len, self.V = max_len, target_vocab_size
        self.caches = [StaticKVCache(1, max_len, cfg.num_key_value_heads, cfg.head_dim, dtype=p.dtype, device=p.device)
                       for _ in head.layers]
        self.draft_ids = head.draft_to_target(torch.arange(cfg.draft_vocab_size, device=p.device))
        self.seq: list[int] = []
        self.pending: Optional[torch.Tensor] = None  # (T, 3H_t) features of positions not yet in the cache

    def reset(self, prompt_ids):
        self.seq, self.pending = list(prompt_ids), None

    def update(self, tokens, aux):
        """Only bookkeeping: the new context goes into the cache in the next `propose`, with the block."""
        self.seq.extend(tokens)
        self.pending = aux if self.pending is None else torch.cat([self.pending, aux])

    @torch.inference_mode()
    def propose(self, drafting: DraftingConfig, sampling: SamplingConfig, generator=None) -> Draft:
        k = drafting.num_speculative_tokens
        if k > self.head.block_size - 1:  # mask slots past the trained block were never trained: refuse, do not guess
            raise DraftsmithError(f"K={k} (drafting.num_speculative_tokens or sweep_k) is more than the "
                                  f"{self.head.block_size - 1} tokens a block of this DFlash head drafts (block_size "
                                  f"{self.head.block_size} in its config.json); draft at most "
                                  f"{self.head.block_size - 1}, or train with method.block_size={k + 1}.")
        logits = self._forward(k)  # (k, Vd): row d-1 drafts x_{L-1+d}
        if sampling.greedy:
            own = logits.argmax(-1)
            q = None
            prob = logits.float().softmax(-1).gather(1, own[:, None])[:, 0]  # (k,) each argmax's probability
        else:
            probs = torch.stack([process_logits(row, sampling) for row in logits])  # (k, Vd)
            own = torch.multinomial(probs.float(), 1, generator=generator)[:, 0]
            q = torch.zeros(k, self.V, dtype=probs.dtype, device=probs.device).index_copy_(1, self.draft_ids, probs)
            prob = probs.gather(1, own[:, None])[:, 0]  # (k,) q(x) of each drawn token
        n = next((d + 1 for d, pr in enumerate(prob.tolist()) if drafting.stops_at(pr)), k)  # dynamic length
        return Draft(self.head.draft_to_target(own[:n]).tolist(), list(range(-1, n - 1)),
                     q[:n] if q is not None else None)

    def _forward(self, k: int) -> torch.Tensor:
        """Write the pending context and run the block [x_{L-1}, k masks] in one forward; its k mask rows' logits."""
        L = len(self.seq)
        T = self.pending.shape[0]
        start = L - 1 - T  # the pending rows are positions [start, L-1)
        width = L + k  # slots in use: context 0 .. L-2, the block L-1 .. L-1+k
        if width > self.max_len:
            raise DraftsmithError(f"DFlash proposer cache is full (max_len={self.max_len}); raise max_len.")
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
