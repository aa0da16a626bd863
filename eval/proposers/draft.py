"""The draft-model proposer: a small HF causal LM sharing the target's tokenizer, with its own static cache (a
TargetRunner); chains and trees from the shared builder (eval/proposers/kit.py)."""

from __future__ import annotations

import torch

from ...core import DraftsmithError
from .kit import ModelProposer
from ..target_runner import TargetRunner


class DraftModelProposer(ModelProposer):
    """A small HF causal LM sharing the tokenizer, with its own static cache (a TargetRunner)."""

    def __init__(self, model, target_vocab_size: int, max_len: int):
        self.runner = TargetRunner(model, max_len, None)
        self.V = target_vocab_size
        self.seq: list[int] = []
        self._chain_fed: list[int] = []  # chain tokens whose K/V sit at slot == position already

    def reset(self, prompt_ids):
        self.seq = list(prompt_ids)
        self.runner.reset()
        self._chain_fed = []

    @torch.inference_mode()
    def update(self, tokens, aux):
        reuse = 0  # accepted chain drafts whose K/V already sit at slot == position
        while reuse < min(len(self._chain_fed), len(tokens) - 1) and self._chain_fed[reuse] == tokens[reuse]:
            reuse += 1
        self.seq.extend(tokens)
        start = self.runner.length + reuse
        new = torch.tensor(self.seq[start:], device=self.runner.device)
        pos = torch.arange(start, len(self.seq), device=self.runner.device)
        logits, _ = self.runner.forward(new, pos, start, logits_rows="last")
        self.runner.commit(len(self.seq))  # slots [0, len(seq)) hold seq
        self._root_logits = self._fit(logits[0])
        self._chain_fed = []

    @torch.inference_mode()
    def _expand(self, nodes, tokens, parents, depth):
        base = self.runner.length  # committed slots [0, base); node i at slot base + i
        start, width = base + nodes[0], base + nodes[-1] + 1
        if width > self.runner.max_len:
            raise DraftsmithError(f"draft model cache is full (max_len={self.runner.max_len}); raise max_len.")
        mask = self._tree_mask(nodes, base, width, self.runner.device)
        ids = torch.tensor([tokens[i] for i in nodes], device=self.runner.device)
        pos = torch.full((len(nodes),), base - 1 + depth, device=self.runner.device)
        logits, _ = self.runner.forward(ids, pos, start, attn_mask=mask)
        if parents == list(range(-1, len(parents) - 1)):
            self._chain_fed = list(tokens)
        return torch.stack([self._fit(row) for row in logits])

    def _fit(self, logits):
        """The draft model's logits cut or padded (with -inf) to the target vocab."""
        if logits.shape[-1] >= self.V:
            return logits[: self.V]
        return torch.cat([logits, logits.new_full((self.V - logits.shape[-1],), float("-inf"))])

    def _to_target(self, own_ids):
        return own_ids

    def _q_target(self, probs):
        return probs


def proposer(model, target_vocab_size: int, max_len: int) -> DraftModelProposer:
    """The method table's hook: the decoder's proposer for a draft model."""
    return DraftModelProposer(model, target_vocab_size, max_len)
