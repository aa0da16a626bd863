"""The P-EAGLE proposer: K draft tokens from ONE drafter forward per cycle (a chain).

After the target verified and emitted tokens, the sequence is x_0 .. x_{L-1}; the target's features are known
for positions up to L-2. One forward runs

    the new depth-0 entries   position p (start .. L-2): token x_{p+1}, hidden fc(f_p)        (cache slot p)
    K-1 mask slots            position L-2+d (d = 1 .. K-1): mask token, fc(mask_hidden)  (cache slot L-2+d)

causally over the cache slots in use (heads/peagle.py: the training layout's mask rule for one anchor). The
logits of entry L-2 draft x_L, those of mask slot d draft x_{L+d}. Entries stay in the cache (one per
position, written once); the mask slots are overwritten by the next cycle's entries, and nothing past the
slots in use is ever read.

Greedy drafts take each depth's argmax; sampled drafts draw each depth from its own q (returned, so the
decoder's rejection rule stays exact: depth d's q does not depend on the tokens drafted before it). Tree
mode drafts the same chain. With `drafting.stop_below` the chain is cut after its first token whose drafter
probability (greedy: softmax at the argmax; sampling: q(x)) is below the threshold; the drafter forward is
already paid, so only verification width is saved; the kept rows' q are unchanged (lossless).
"""

from __future__ import annotations

from typing import Optional

import torch

from draftsmith.core import DraftsmithError
from draftsmith.eval.decoder import Draft, DraftingConfig
from draftsmith.eval.proposers.kit import eval_head
from draftsmith.heads.kit import StaticKVCache
from draftsmith.heads.peagle import PEagleHead
from draftsmith.core.sampling import SamplingConfig, process_logits


class PEagleProposer:
    needs_aux = True

    def __init__(self, head, target_vocab_size: int, max_len: int):
        cfg = head.config
        self.head, p = eval_head(head, target_vocab_size, "P-EAGLE")
        self.device = p.device
        self.max_len, self.V = max_len, target_vocab_size
        self.caches = [StaticKVCache(1, max_len, cfg.num_key_value_heads, cfg.head_dim, dtype=p.dtype, device=p.device)
                       for _ in head.layers]
        self.draft_ids = head.draft_to_target(torch.arange(cfg.draft_vocab_size, device=p.device))
        with torch.inference_mode():
            self.mask_fused = head.mask_fused()  # (H,) every cycle's mask slots read it
        self.seq: list[int] = []
        self.pending: Optional[torch.Tensor] = None  # (T, 3H_t) features of entries not yet run

    def reset(self, prompt_ids):
        self.seq, self.pending = list(prompt_ids), None

    def update(self, tokens, aux):
        """Only bookkeeping: the entries run in the next `propose`, together with the mask slots."""
        self.seq.extend(tokens)
        self.pending = aux if self.pending is None else torch.cat([self.pending, aux])

    @torch.inference_mode()
    def propose(self, drafting: DraftingConfig, sampling: SamplingConfig, generator=None) -> Draft:
        k = drafting.num_speculative_tokens
        depths = getattr(self.head.config, "num_depths", None)
        if depths is not None and k > depths:  # its deeper mask slots were never trained: refuse, do not guess
            raise DraftsmithError(f"K={k} (drafting.num_speculative_tokens or sweep_k) is more than the {depths} "
                                  f"depths this P-EAGLE head was trained for (num_depths in its config.json); "
                                  f"draft at most {depths} tokens, or train with method.depths={k}.")
        logits = self._forward(k)  # (k, Vd): row d drafts x_{L+d}
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
        """Run the pending entries and k-1 mask slots in one forward; the k rows of draft logits."""
        L = len(self.seq)
        T = self.pending.shape[0]
        start = L - 1 - T  # the pending rows are positions [start, L-1)
        width = L - 1 + k - 1  # slots in use: entries 0 .. L-2, mask slots L-1 .. L+k-3
        if width > self.max_len:
            raise DraftsmithError(f"P-EAGLE proposer cache is full (max_len={self.max_len}); raise max_len.")
        ids = torch.tensor(self.seq[start + 1:] + [self.head.mask_token_id] * (k - 1), device=self.device)[None]
        fused = self.head.fuse(self.pending[None].to(self.device))  # (1, T, H)
        hidden = torch.cat([fused, self.mask_fused.to(fused.dtype).expand(1, k - 1, -1)], dim=1)  # (1, T+k-1, H)
        pos = torch.arange(start, width, device=self.device)  # slot == position
        mask = (torch.arange(width, device=self.device)[None, :] <= pos[:, None])[None, None]  # (1, 1, N, width)
        _, logits = self.head(ids, hidden, pos[None], mask, self.caches, pos)
        self.pending = self.pending[:0]  # the entries now sit in the cache
        return logits[0, T - 1:]  # the last entry and the mask slots


def proposer(head: PEagleHead, target_vocab_size: int, max_len: int) -> PEagleProposer:
    """The method table's hook: the decoder's proposer for a P-EAGLE head."""
    return PEagleProposer(head, target_vocab_size, max_len)
