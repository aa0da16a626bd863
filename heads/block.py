"""The block drafter both block methods are built on (DFlash's drafter, which DSpark extends with two small heads:
heads/dspark.py): a block of K tokens from ONE forward, conditioned on the target's hidden states as context keys
and values in every layer (vLLM's `DFlashQwen3ForCausalLM`, heads/dflash_folders.py).

Read top to bottom: config -> attention -> layer -> head -> the training layout's mask.

    c      = hidden_norm(fc(cat(aux_hidden_states)))              # (B, C, H) context, never a query
    layer l: context keys / values  k = rope(k_norm(k_proj_l(c))), v = v_proj_l(c)     (every layer, same c)
             query block h: x = input_layernorm(h); q, k, v from x (q_norm / k_norm per head, RoPE)
             h += o_proj(attn(q, [context keys; block keys]));  h += mlp(post_attention_layernorm(h))
    h_0    = embed([bonus, mask, ..., mask])                        # the block, positions p .. p+K
    logits = lm_head(norm(h))  over the draft vocab; the mask query at position p+k drafts the token AT p+k

Attention is non-causal inside a block: every query sees the context keys before the block and the whole
block. The layers are Qwen3-shaped (per-head q_norm / k_norm) whatever the target is: that is the drafter
vLLM builds for `DFlashDraftModel`. Tensor names are the folder's: `fc`, `hidden_norm`, `layers.{i}.*`
(with `self_attn.q_norm` / `k_norm`), `norm`, `lm_head`, `d2t`, `t2d`, `embed_tokens`.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, cast

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

from .kit import DraftVocabHead, attention_sizes, cached_attention, draft_config_from_target


def dflash_config_from_target(target_config, draft_vocab_size: int, num_layers: int, block_size: int,
                              mask_token_id: int, aux_layer_ids: Sequence[int]) -> LlamaConfig:
    """The drafter's config: the kit's (target-matching sizes) with `num_layers` layers, the block size it was
    trained with (K = block_size - 1 drafted tokens), the mask token id and the target layers it reads (HF
    hidden_states indices)."""
    config = draft_config_from_target(target_config, draft_vocab_size)
    config.num_hidden_layers = int(num_layers)
    config.block_size = int(block_size)
    config.mask_token_id = int(mask_token_id)
    config.aux_layer_ids = [int(i) for i in aux_layer_ids]
    return config


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (HF rotate_half, vLLM's neox style) on one (B, n, T, d) tensor."""
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


class DFlashAttention(nn.Module):
    """Attention of one DFlash layer: queries from the block, keys / values from the context and the block."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        H = config.hidden_size
        self.n_heads, self.n_kv_heads, self.head_dim = attention_sizes(config)
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=False)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, H) -> k (B, nkv, T, d) normed and rotated, v (B, nkv, T, d)."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos, sin, context: Optional[tuple[torch.Tensor, torch.Tensor]],
                attn_mask: torch.Tensor, kv_cache, cache_positions: Optional[torch.Tensor]) -> torch.Tensor:
        """x (B, N, H) the block's normed input; context (k, v) of the new context tokens (or None); keys are
        [context; block] in that order (the cache, when given, writes them at `cache_positions`)."""
        B, N, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, N, self.n_heads, self.head_dim)).transpose(1, 2)  # (B, nh, N, d)
        q = rope(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)  # (B, nkv, N, d)
        if context is not None:
            k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)  # (B, nkv, C+N, d)
        y = cached_attention(q, k, v, kv_cache, cache_positions, attn_mask, self.n_heads // self.n_kv_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, N, self.n_heads * self.head_dim))


class DFlashLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer whose attention also reads the context keys / values."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, h, cos, sin, context, attn_mask, kv_cache, cache_positions):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context, attn_mask, kv_cache, cache_positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashHead(DraftVocabHead):
    """DFlash drafter. `d2t[i]`: target id = i + d2t[i]; `t2d[t]`: target id t is in the draft vocab."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.add_inputs(config, train_embeddings=False)  # embed_tokens: a frozen copy of the target's; fc: 3H_t -> H
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_hidden_layers)])
        self.add_outputs(config)

    @property
    def mask_token_id(self) -> int:
        return int(self.config.mask_token_id)

    @property
    def block_size(self) -> int:
        return int(self.config.block_size)

    def context(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, C, 3H_t) target features -> (B, C, H) context states c = hidden_norm(fc(.))."""
        return self.hidden_norm(self.fc(aux_hidden_states.to(self.fc.weight.dtype)))

    def trunk(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Optional[torch.Tensor],
              context_positions: Optional[torch.Tensor], attn_mask: torch.Tensor,
              kv_caches: Optional[Sequence] = None, cache_positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layer stack over a block (or a batch of blocks): (B, N) tokens at (B, N) positions; context (B, C, H)
        states at (B, C) positions (None: all already cached); attn_mask (B or 1, 1, N, S) bool over the keys
        [context; block] (S = C + N without caches, else the cache slots in use) -> pre-norm (B, N, H)."""
        h = self.embed_tokens(input_ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary_emb(h, positions)
        ctx = (context, *self.rotary_emb(h, context_positions)) if context is not None else None
        caches = kv_caches if kv_caches is not None else [None] * len(self.layers)
        for layer, cache in zip(cast(Iterable[DFlashLayer], self.layers), caches):
            kv = layer.self_attn.keys_values(*ctx) if ctx is not None else None
            h = layer(h, cos, sin, kv, attn_mask, cache, cache_positions)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def forward(self, input_ids, positions, context, context_positions, attn_mask, kv_caches=None,
                cache_positions=None):
        """(pre-norm hidden (B, N, H), logits (B, N, Vd)); arguments as `trunk`."""
        h = self.trunk(input_ids, positions, context, context_positions, attn_mask, kv_caches, cache_positions)
        return h, self.logits(h)


def block_mask(anchor: torch.Tensor, block_size: int, key_ok: torch.Tensor) -> torch.Tensor:
    """(B, 1, n*block_size, T + n*block_size) bool attention of n blocks per row over [context (T); blocks]:
    a query of block j sees the context positions before anchor[j] that hold a real token (key_ok (B, T)) and
    every query of its own block (non-causal), nothing else. anchor (B, n) long; a padding block (anchor 0)
    sees only itself."""
    B, n = anchor.shape
    T = key_ok.shape[1]
    q_anchor = anchor.repeat_interleave(block_size, dim=1)  # (B, N) each query's block anchor
    ctx = (torch.arange(T, device=anchor.device)[None, None, :] < q_anchor[:, :, None]) & key_ok.bool()[:, None, :]
    block = torch.arange(n, device=anchor.device).repeat_interleave(block_size)  # (N,) each query's block index
    own = (block[:, None] == block[None, :])[None].expand(B, -1, -1)  # (B, N, N)
    return torch.cat([ctx, own], dim=2)[:, None]
