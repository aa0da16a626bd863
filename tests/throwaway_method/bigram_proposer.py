"""The bigram's proposer (the method table's eval hook)."""

from __future__ import annotations

import torch

from draftsmith.eval.decoder import Draft


class BigramProposer:
    """A greedy chain from the bigram table (q one-hot: lossless under sampling too)."""

    needs_aux = False

    def __init__(self, drafter):
        self.drafter, self.last = drafter, None

    def reset(self, prompt_ids):
        self.last = prompt_ids[-1]

    def update(self, tokens, aux):
        self.last = tokens[-1]

    @torch.no_grad()
    def propose(self, drafting, sampling, generator=None):
        tokens, tok = [], self.last
        for _ in range(drafting.num_speculative_tokens):
            tok = int(self.drafter(torch.tensor([tok])).argmax(-1))
            tokens.append(tok)
        return Draft(tokens, list(range(-1, len(tokens) - 1)))


def proposer(drafter, target_vocab_size, max_len):
    return BigramProposer(drafter)
