"""The EAGLE-3 drafter: one decoder layer fed by three fused target layers.

Read top to bottom: config -> KV caches -> attention -> decoder layer -> head.

    fused = fc(cat(aux_hidden_states))                         # (B, T, 3H_t) -> (B, T, H)
    x     = cat(input_layernorm(embed(token)), hidden_norm(h))  # (B, T, 2H), embedding first
    h'    = h + o_proj(attn(q/k/v from x))                      # residual is the un-normed h
    h'    = h' + mlp(post_attention_layernorm(h'))
    logits = lm_head(norm(h'))  over the draft vocab           # h' (PRE-norm) is the next step's h

Attention always takes explicit positions, an explicit boolean mask and a KV cache object:
`StaticKVCache` (position-indexed buffers, inference: no copies on rejection) or `ConcatKVCache`
(autograd-safe append, used by the training-time-test unroll). The tensor names match the
checkpoint format vLLM and SGLang load (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)


def eagle3_config_from_target(target_config, draft_vocab_size: int) -> LlamaConfig:
    """The head's config: a 1-layer Llama matching the target's width, heads, rope and eps.

    This is also (plus architectures / d2t fields added at save time) the config.json engines read.
    """
    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    rope = getattr(target_config, "rope_parameters", None) or {
        "rope_type": "default", "rope_theta": getattr(target_config, "rope_theta", 10000.0)}
    config = LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=target_config.num_attention_heads,
        num_key_value_heads=target_config.num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        hidden_act=getattr(target_config, "hidden_act", "silu"),
        rope_parameters=dict(rope),
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    config.draft_vocab_size = int(min(draft_vocab_size, target_config.vocab_size))
    config.target_hidden_size = target_config.hidden_size
    return config


class StaticKVCache(nn.Module):
    """Position-indexed K/V buffers (B, n_kv, max_len, d): `update` writes at `cache_positions`, returns all
    slots; attention reads only the first S of them, S = its mask's width (the slots in use)."""

    def __init__(self, batch_size: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, cache_positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # k, v: (B, n_kv, T, d); cache_positions: (T,) slots to write
        self.k_cache.index_copy_(2, cache_positions, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, cache_positions, v.to(self.v_cache.dtype))
        return self.k_cache, self.v_cache


class ConcatKVCache:
    """Append-only K/V for the training-time-test unroll: keys of step i are keys[0..i] concatenated.

    Concatenation (not in-place writes) keeps every step's keys in the autograd graph.
    """

    def __init__(self):
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def update(self, cache_positions, k: torch.Tensor, v: torch.Tensor):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class Eagle3Attention(nn.Module):
    """Attention whose q/k/v project from the 2H-wide [embedding; hidden] input (`in_dim` = H for the
    plain layers P-EAGLE stacks after this one)."""

    def __init__(self, config: LlamaConfig, in_dim: Optional[int] = None):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        in_dim = in_dim or 2 * config.hidden_size
        self.q_proj = nn.Linear(in_dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor,
                kv_cache, cache_positions: Optional[torch.Tensor]) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, d)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, d)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(cache_positions, k, v)  # (B, nkv, S_cache, d)
            S = attn_mask.shape[-1]  # the mask covers the first S slots: the rest are never read
            k, v = k[:, :, :S], v[:, :, :S]  # (B, nkv, S, d)
        rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(rep, dim=1).to(q.dtype)  # (B, nh, S, d)
        v = v.repeat_interleave(rep, dim=1).to(q.dtype)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, nh, T, d)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds, hidden, cos, sin, attn_mask, kv_cache, cache_positions):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        h = hidden + self.self_attn(x, cos, sin, attn_mask, kv_cache, cache_positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """EAGLE-3 drafter. `d2t[i]`: target id = i + d2t[i]; `t2d[t]`: target id t is in the draft vocab."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        H, Vd = config.hidden_size, config.draft_vocab_size
        target_hidden = getattr(config, "target_hidden_size", None) or H
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's
        self.fc = nn.Linear(3 * target_hidden, H, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

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

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def init_from_target(self, target_model, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Copy the target's embeddings (frozen) and its lm_head rows for the draft vocab; set the vocab map."""
        self.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
        used = torch.arange(d2t.numel(), device=d2t.device) + d2t  # target ids of the draft vocab
        self.lm_head.weight.copy_(target_model.get_output_embeddings().weight[used.to(self.lm_head.weight.device)])
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)


def causal_mask(T: int, device=None) -> torch.Tensor:
    """(1, 1, T, T) bool lower-triangular mask."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """Training-time-test mask for unroll step `step` over keys [step 0 | step 1 | ... | step `step`].

    Query t attends causally to step-0 keys (<= t) and, in each later step, only to its own
    index t (the same sequence slot, one position further on). Shape (1, 1, T, (step+1)*T).
    """
    eye = torch.eye(T, dtype=torch.bool, device=device)
    blocks = [torch.ones(T, T, dtype=torch.bool, device=device).tril()] + [eye] * step
    return torch.cat(blocks, dim=1)[None, None]


def num_parameters(module: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


