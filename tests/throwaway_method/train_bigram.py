"""The bigram's training step (the method table's training hooks)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.core.method_hooks import TrainingHooks
from throwaway_method.bigram import Bigram


@dataclass
class BigramConfig:
    name: str = "bigram"  # the method
    hidden: int = 16  # embedding width


class BigramStep(nn.Module):
    def __init__(self, drafter: Bigram):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, attention_mask, loss_mask, **_):
        logits = self.drafter(input_ids[:, :-1]).float()
        mask = (loss_mask[:, 1:] * attention_mask[:, 1:]).bool()
        ce = F.cross_entropy(logits[mask], input_ids[:, 1:][mask])
        n = mask.sum().float()
        return ce, torch.stack([ce.detach() * n, n])[None]  # (steps=1, stats)


def new_drafter(target, cfg, train, resume):
    return Bigram(SimpleNamespace(vocab_size=target.vocab_size, hidden=cfg.hidden))


def training(drafter, target, cfg, mode, autocast):
    return BigramStep(drafter), lambda batch: {k: v for k, v in batch.items() if k not in ("aux", "last")}


def summarize(stats):
    s = stats.double()
    return {"loss_0": (s[0, 0] / s[0, 1].clamp(min=1)).item()}


HOOKS = TrainingHooks(config=BigramConfig, offline_data="hidden_states", new_drafter=new_drafter, training=training,
                      summarize=summarize)
