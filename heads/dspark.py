"""The DSpark drafter (DeepSeek's DeepSpec, `deepspec/modeling/dspark/`): the block drafter of heads/block.py (DFlash's)
plus two small heads that read each slot's previous token.

    h_k      = the block drafter's pre-norm hidden of slot k: slot 0 is the bonus token x_p at position p, slot k >= 1
               the mask query at p+k that drafts x_{p+k} (draftsmith's bonus-anchor layout, `sample_from_anchor:
               false`: DFlash's)
    prev_k   = x_{p+k-1}, the token before the one slot k drafts: the bonus token x_p for slot 1; for k >= 2 the
               token drafted at slot k-1 (inference) or the true one (training: teacher forced)
    e_k      = W1[prev_k]                                   (r,)   markov_head.markov_w1  Embedding(V_target, r)
    logits_k = lm_head(norm(h_k)) + W2 e_k                  (Vd,)  markov_head.markov_w2  Linear(r, Vd), no bias
    conf_k   = sigmoid(proj([norm(h_k); e_k]))              ()     confidence_head.proj   Linear(H + r, 1)

The backbone is still one forward per block; the bias makes slot k's distribution depend on the token drafted at
slot k-1, so the block is sampled slot by slot (eval/proposers/dspark.py). conf_k predicts the probability that
slot k's draft is accepted when the slots before it were (trained on 1 - TV: train/dspark.py); llama.cpp stops a
draft before the first slot whose conf_k is below `--spec-draft-p-min`. The tensor names are llama.cpp's and
DeepSpec's (the vanilla Markov head; DeepSpec's gated and RNN variants are not served by llama.cpp or vLLM).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig

from .block import DFlashHead, dflash_config_from_target

DEFAULT_MARKOV_RANK = 256  # DeepSpec's, speculators' and llama.cpp's examples


def dspark_config_from_target(target_config, draft_vocab_size: int, num_layers: int, block_size: int,
                              mask_token_id: int, aux_layer_ids, markov_rank: int) -> LlamaConfig:
    """The block drafter's config (heads/block.py) plus the rank r of the Markov head."""
    config = dflash_config_from_target(target_config, draft_vocab_size, num_layers, block_size, mask_token_id,
                                       aux_layer_ids)
    config.markov_rank = int(markov_rank)
    return config


class MarkovHead(nn.Module):
    """The vanilla Markov head: a low-rank logit bias W2 · W1[previous token] over the draft vocab."""

    def __init__(self, target_vocab_size: int, rank: int, draft_vocab_size: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(target_vocab_size, rank)  # indexed by TARGET ids (the previous token)
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # DeepSpec's / speculators' init: the bias starts near 0
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """The slot's acceptance predictor: one logit from [norm(h_k); W1[prev_k]]."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)


class DSparkHead(DFlashHead):
    """DSpark drafter: the block drafter plus `markov_head` and `confidence_head` (module docstring)."""

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        r = int(config.markov_rank)
        self.markov_head = MarkovHead(config.vocab_size, r, config.draft_vocab_size)
        self.confidence_head = ConfidenceHead(config.hidden_size + r)

    @property
    def markov_rank(self) -> int:
        return int(self.config.markov_rank)

    def slot_outputs(self, h: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (..., H) pre-norm hidden of slots, prev (...) the target ids of their previous tokens -> (logits (..., Vd)
        with the Markov bias, confidence logits (...), before the sigmoid)."""
        x = self.norm(h)  # (..., H)
        e = self.markov_head.markov_w1(prev).to(x.dtype)  # (..., r)
        logits = self.lm_head(x) + self.markov_head.markov_w2(e)
        conf = self.confidence_head.proj(torch.cat([x, e], dim=-1)).squeeze(-1)
        return logits, conf
