"""The EAGLE-3 drafter: one decoder layer fed by three fused target layers.

Read top to bottom: config -> head -> the training-time-test mask. The layer, attention and KV caches are the
shared kit's (heads/kit.py: `FusedInputLayer`, `Attention`, `StaticKVCache`, `ConcatKVCache`).

    fused = fc(cat(aux_hidden_states))                         # (B, T, 3H_t) -> (B, T, H)
    x     = cat(input_layernorm(embed(token)), hidden_norm(h))  # (B, T, 2H), embedding first
    h'    = h + o_proj(attn(q/k/v from x))                      # residual is the un-normed h
    h'    = h' + mlp(post_attention_layernorm(h'))
    logits = lm_head(norm(h'))  over the draft vocab           # h' (PRE-norm) is the next step's h

The tensor names match the checkpoint format vLLM and SGLang load (`fc`, `midlayer.*`, `norm`, `lm_head`,
`d2t`, `t2d`).
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import LlamaConfig

from draftsmith.heads.kit import DraftVocabHead, FusedInputLayer, draft_config_from_target


def eagle3_config_from_target(target_config, draft_vocab_size: int) -> LlamaConfig:
    """The head's config: a 1-layer Llama matching the target's width, heads, rope and eps.

    This is also (plus architectures / d2t fields added at save time) the config.json engines read.
    """
    return draft_config_from_target(target_config, draft_vocab_size)


class Eagle3Head(DraftVocabHead):
    """EAGLE-3 drafter. `d2t[i]`: target id = i + d2t[i]; `t2d[t]`: target id t is in the draft vocab."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.add_inputs(config, train_embeddings=False)  # embed_tokens: a frozen copy of the target's
        self.midlayer = FusedInputLayer(config)
        self.add_outputs(config)

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, 3H_t) target features -> (B, T, H) step-0 hidden."""
        return self.fc(aux_hidden_states.to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attn_mask: torch.Tensor, kv_cache=None, cache_positions: Optional[torch.Tensor] = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step.

        input_ids (B, T), hidden (B, T, H) [fused features or the previous step's output],
        position_ids (B, T), attn_mask (B or 1, 1, T, S) bool (True = attend) over the cache's first
        S slots (a StaticKVCache: only the slots in use need to be covered; S = T without a cache). Returns (pre-norm hidden (B, T, H), logits (B, T, Vd)).
        """
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        h = self.midlayer(embeds, hidden, cos, sin, attn_mask, kv_cache, cache_positions)
        return h, self.lm_head(self.norm(h))


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """Training-time-test mask for unroll step `step` over keys [step 0 | step 1 | ... | step `step`].

    Query t attends causally to step-0 keys (<= t) and, in each later step, only to its own
    index t (the same sequence slot, one position further on). Shape (1, 1, T, (step+1)*T).
    """
    eye = torch.eye(T, dtype=torch.bool, device=device)
    blocks = [torch.ones(T, T, dtype=torch.bool, device=device).tril()] + [eye] * step
    return torch.cat(blocks, dim=1)[None, None]
