"""The drafter: next token from the current one (embed -> linear over the target vocab)."""

from __future__ import annotations

import torch
from torch import nn

ARCH = "ThrowawayBigram"


class Bigram(nn.Module):
    """Next token from the current one: embed -> linear over the target vocab."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.out = nn.Linear(config.hidden, config.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))
