"""Sampling, one rule for every stage: data-gen's regeneration and eval's decoder both use it.

    probabilities = process_logits(logits, SamplingConfig(temperature, top_k, top_p))

temperature 0 means greedy (callers take the argmax and never call process_logits); top-k keeps
the k largest logits (0 = off); top-p keeps the smallest set of most probable tokens whose
probability reaches top_p (cumulative >= top_p; the most probable token is always kept), as
transformers' TopPLogitsWarper, vLLM and SGLang do. top-k is applied before top-p.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from draftsmith.core import DraftsmithError


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # nucleus sampling, in (0, 1]

    def __post_init__(self):
        if self.temperature < 0:
            raise DraftsmithError(f"temperature={self.temperature} must be >= 0 (0 = greedy).")
        if self.top_k < 0:
            raise DraftsmithError(f"top_k={self.top_k} must be >= 0 (0 = off).")
        if not 0 < self.top_p <= 1:
            raise DraftsmithError(f"top_p={self.top_p} must be in (0, 1].")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p -> probabilities (..., V), in float64. Not for greedy."""
    x = logits.double() / sampling.temperature
    if sampling.top_k and sampling.top_k < x.shape[-1]:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[..., -1:]  # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p = sorted_x.softmax(-1)
        drop = p.cumsum(-1) - p >= sampling.top_p  # the tokens before it already reach top_p
        drop[..., 0] = False  # the most probable token always stays
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return x.softmax(-1)


def hash_seed(seed: int, *parts) -> int:
    """A stable 63-bit seed from a base seed and any parts (independent of batching and ranks)."""
    h = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)
