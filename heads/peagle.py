"""The P-EAGLE drafter: an EAGLE-3-style head with several decoder layers that drafts K tokens in ONE forward.

Read top to bottom: config -> head -> slot layout (the layers are the shared kit's, heads/kit.py).

A drafting forward holds "slots". Slot (anchor t, depth 0) is an ordinary EAGLE-3 step 0: token x_{t+1},
features fc(f_t), position t. Slot (t, d >= 1) stands for a token not known yet: the mask token id and
the learnable `mask_hidden` (3H_t wide, through the same fc) in place of target features, at position
t + d. Every slot's logits draft the token after its position: slot (t, d) drafts x_{t+2+d}.

    fused  = fc(f_t) at depth 0, fc(mask_hidden) at depth >= 1            # (B, N, H)
    h      = layers[0](embed(token), fused)                                # the fused-input layer (2H input)
    h      = layers[i](h) for i >= 1                                       # plain Llama layers (H input)
    logits = lm_head(norm(h))  over the draft vocab

Attention (`slot_mask`): a slot sees the depth-0 slots of its anchor's causal prefix (real tokens only)
and its own group's earlier depths, nothing else. At inference the last accepted position is the
anchor and its K-1 mask slots follow it, so the layout is plain causal (eval's P-EAGLE proposer).

Tensor names are those of the folder vLLM loads for parallel drafting (heads/peagle_folders.py):
`fc`, `layers.0.*` (with `hidden_norm`), `layers.{i}.*`, `norm`, `lm_head`, `mask_hidden`, `d2t`, `t2d`,
`embed_tokens`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn
from transformers import LlamaConfig

from .kit import DraftVocabHead, FusedInputLayer, PlainLayer, draft_config_from_target


def peagle_config_from_target(target_config, draft_vocab_size: int, num_layers: int, mask_token_id: int,
                              train_embeddings: bool = True, num_depths: Optional[int] = None) -> LlamaConfig:
    """The head's config: the kit's (target-matching sizes) with `num_layers` layers, the mask token id and
    the depths it is trained for (`num_depths`: it drafts at most that many tokens; None = not known)."""
    config = draft_config_from_target(target_config, draft_vocab_size)
    config.num_hidden_layers = int(num_layers)
    config.mask_token_id = int(mask_token_id)
    config.train_embeddings = bool(train_embeddings)
    config.num_depths = None if num_depths is None else int(num_depths)
    return config


class PEagleHead(DraftVocabHead):
    """P-EAGLE drafter. `d2t[i]`: target id = i + d2t[i]; `t2d[t]`: target id t is in the draft vocab."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        target_hidden = self.add_inputs(config, bool(getattr(config, "train_embeddings", True)))
        # what stands in for the target's features at depth >= 1 (speculators initialises it N(0, 1) too)
        self.mask_hidden = nn.Parameter(torch.randn(1, 3 * target_hidden))
        self.layers = nn.ModuleList([FusedInputLayer(config)] +
                                    [PlainLayer(config) for _ in range(config.num_hidden_layers - 1)])
        self.add_outputs(config)

    @property
    def mask_token_id(self) -> int:
        return int(self.config.mask_token_id)

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, 3H_t) target features -> (B, T, H) depth-0 hidden."""
        return self.fc(aux_hidden_states.to(self.fc.weight.dtype))

    def mask_fused(self) -> torch.Tensor:
        """(H,) the hidden every depth >= 1 slot reads: fc(mask_hidden)."""
        return self.fc(self.mask_hidden)[0]

    def trunk(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
              attn_mask: torch.Tensor, kv_caches: Optional[Sequence] = None,
              cache_positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layer stack: (B, N) tokens, (B, N, H) fused hidden, (B, N) positions, (B or 1, 1, N, S) bool
        mask (True = attend; S = N without caches, else the cache slots in use) -> pre-norm (B, N, H)."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        caches = kv_caches if kv_caches is not None else [None] * len(self.layers)
        h = self.layers[0](embeds, hidden, cos, sin, attn_mask, caches[0], cache_positions)
        for layer, cache in zip(self.layers[1:], caches[1:]):
            h = layer(h, cos, sin, attn_mask, cache, cache_positions)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def forward(self, input_ids, hidden, position_ids, attn_mask, kv_caches=None, cache_positions=None):
        """(pre-norm hidden (B, N, H), logits (B, N, Vd)); arguments as `trunk`."""
        h = self.trunk(input_ids, hidden, position_ids, attn_mask, kv_caches, cache_positions)
        return h, self.logits(h)


def slot_mask(anchor: torch.Tensor, depth: torch.Tensor, real: torch.Tensor, key_ok: torch.Tensor) -> torch.Tensor:
    """(B, 1, N, N) bool attention over slots: query i sees key j iff j is a depth-0 slot of a real token at or
    before i's anchor, or j is in i's own group at a depth <= i's.

    anchor, depth (B, N) long; real (B, N) bool (False = a padding slot of the batch layout: it sees only itself);
    key_ok (B, T) bool: the anchor position holds a real token (the attention mask).
    """
    a_q, a_k = anchor[:, :, None], anchor[:, None, :]  # (B, N, 1), (B, 1, N)
    d_q, d_k = depth[:, :, None], depth[:, None, :]
    real_token = torch.gather(key_ok, 1, anchor.clamp(min=0)) & real  # (B, N)
    prefix = (d_k == 0) & (a_k <= a_q) & real_token[:, None, :]
    own_group = (a_k == a_q) & (d_k <= d_q) & real[:, None, :] & (d_k > 0)
    mask = (prefix | own_group) & real[:, :, None]
    eye = torch.eye(anchor.shape[1], dtype=torch.bool, device=anchor.device)[None]
    return (mask | (eye & ~real[:, :, None]))[:, None]  # a padding slot attends to itself only (no empty row)
