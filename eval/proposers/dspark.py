"""The DSpark proposer: one block forward per cycle (DFlash's, eval/proposers/kit.py `BlockProposer`), then the K mask
rows drafted slot by slot, each with the Markov bias of the token drafted before it (heads/dspark.py):

    prev = x_{L-1} (the bonus token, the block's slot 0)
    for d = 1 .. K:   logits_d, conf_d = slot_outputs(h_d, prev)
                      stop before slot d when conf_d < drafting.stop_below (llama.cpp's --spec-draft-p-min for
                      draft-dspark): read from the confidence, never from slot d's draw
                      x_d = argmax(logits_d) (greedy) or one draw from q_d = process_logits(logits_d) (temperature /
                      top-k / top-p, as every proposer), q_d kept over the target vocab;  prev = x_d

Lossless: q_d depends only on the committed sequence and the drafts before slot d, and the verifier reaches slot d only
when those drafts were accepted, i.e. equal the tokens it has committed; it then accepts x_d with min(1, p/q_d) under
the q_d it was drawn from. The stop decision reads conf_d, a function of the same prefix, so it is a stopping time of
the chain and changes only how many slots are verified. Tree mode drafts the same chain.
"""

from __future__ import annotations

import torch

from ...core.sampling import SamplingConfig, process_logits
from ..decoder import Draft, DraftingConfig
from .kit import BlockProposer
from ...heads.dspark import DSparkHead


class DSparkProposer(BlockProposer):
    def __init__(self, head: DSparkHead, target_vocab_size: int, max_len: int):
        super().__init__(head, target_vocab_size, max_len, "DSpark")

    @torch.inference_mode()
    def propose(self, drafting: DraftingConfig, sampling: SamplingConfig, generator=None) -> Draft:
        num_speculative_tokens = drafting.num_speculative_tokens
        self._check_num_speculative_tokens(num_speculative_tokens)
        h = self._block(num_speculative_tokens)[1:]  # (K, H) the mask rows
        prev = torch.tensor(self.seq[-1], device=self.device)  # target id of the token before slot 1
        tokens, qs = [], []
        for d in range(num_speculative_tokens):
            logits, conf = self.head.slot_outputs(h[d], prev)  # (Vd,), ()
            if drafting.stops_at(float(torch.sigmoid(conf))):  # dynamic draft length: the drafter expects a reject
                break
            if sampling.greedy:
                own = logits.argmax()
            else:
                probs = process_logits(logits, sampling)  # (Vd,)
                own = torch.multinomial(probs.float(), 1, generator=generator)[0]
                qs.append(torch.zeros(self.V, dtype=probs.dtype, device=probs.device).index_copy_(0, self.draft_ids,
                                                                                                   probs))
            prev = self.draft_ids[own]
            tokens.append(int(prev))
        return Draft(tokens, list(range(-1, len(tokens) - 1)), torch.stack(qs) if qs else None)


def proposer(head: DSparkHead, target_vocab_size: int, max_len: int) -> DSparkProposer:
    """The method table's hook: the decoder's proposer for a DSpark drafter."""
    return DSparkProposer(head, target_vocab_size, max_len)
