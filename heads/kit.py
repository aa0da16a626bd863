"""What every feature-fed drafter is built from: its Llama-shaped config, KV caches, attention, the fused-input
decoder layer and the draft-vocab map (built in heads/vocab.py). A method's head (heads/<method>.py) imports this
kit, never a sibling method.

    x = cat(input_layernorm(embed(token)), hidden_norm(h))  # (B, T, 2H), embedding first: FusedInputLayer
    h' = h + o_proj(attn(q/k/v from x))                      # the residual is the un-normed h
    h' = h' + mlp(post_attention_layernorm(h'))

Attention always takes explicit positions, an explicit boolean mask and a KV cache object: `StaticKVCache`
(position-indexed buffers, inference: no copies on rejection) or `ConcatKVCache` (autograd-safe append, used by
training unrolls).
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from .vocab import draft_vocab_ids


DEFAULT_ROPE_THETA = 10000.0  # Llama's, for a config that names none (transformers' default too)


def draft_config_from_target(target_config, draft_vocab_size: int) -> LlamaConfig:
    """A 1-layer Llama config matching the target's width, heads, rope and eps, over a draft vocab of at most the
    target's size (the base of every feature-fed drafter's config, and of the config.json engines read)."""
    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    rope = getattr(target_config, "rope_parameters", None) or {
        "rope_type": "default", "rope_theta": getattr(target_config, "rope_theta", DEFAULT_ROPE_THETA)}
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


def attention_sizes(config: LlamaConfig) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a Llama-shaped config. LlamaConfig types the last two Optional and fills
    them in when a config names none (its __post_init__: num_attention_heads, hidden_size // num_attention_heads);
    the same fallbacks here."""
    n_heads = config.num_attention_heads
    n_kv_heads = config.num_key_value_heads if config.num_key_value_heads is not None else n_heads
    head_dim = config.head_dim if config.head_dim is not None else config.hidden_size // n_heads
    return n_heads, n_kv_heads, head_dim


class KVCache(Protocol):
    """What attention writes its keys / values into (StaticKVCache, ConcatKVCache): `update` stores k, v (B, nkv, T,
    d) for `cache_positions` and returns the keys / values attention reads (B, nkv, S_cache, d)."""

    def update(self, cache_positions: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class StaticKVCache(nn.Module):
    """Position-indexed K/V buffers (B, n_kv, max_len, d): `update` writes at `cache_positions`, returns all
    slots; attention reads only the first S of them, S = its mask's width (the slots in use)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, batch_size: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, cache_positions: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: (B, n_kv, T, d); cache_positions: (T,) slots to write
        self.k_cache.index_copy_(2, cache_positions, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, cache_positions, v.to(self.v_cache.dtype))
        return self.k_cache, self.v_cache


class ConcatKVCache:
    """Append-only K/V for a training unroll: keys of step i are keys[0..i] concatenated.

    Concatenation (not in-place writes) keeps every step's keys in the autograd graph.
    """

    def __init__(self):
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def update(self, cache_positions: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Optional[KVCache], cache_positions,
                     attn_mask: Optional[torch.Tensor], rep: int) -> torch.Tensor:
    """Attention of q (B, nh, T, d) over k / v (B, nkv, T', d), written into `kv_cache` first when there is one (then
    the mask covers the first S slots: the rest are never read), each KV head repeated `rep` times for its query
    heads; (B, nh, T, d). The drafters' attentions share it (EAGLE-3's and P-EAGLE's layer, DFlash's)."""
    if kv_cache is not None:
        k, v = kv_cache.update(cache_positions, k, v)  # (B, nkv, S_cache, d)
        assert attn_mask is not None, "with a KV cache, the mask's width is the number of slots in use"
        S = attn_mask.shape[-1]
        k, v = k[:, :, :S], v[:, :, :S]  # (B, nkv, S, d)
    k = k.repeat_interleave(rep, dim=1).to(q.dtype)  # (B, nh, S, d)
    v = v.repeat_interleave(rep, dim=1).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


class Attention(nn.Module):
    """Attention whose q/k/v project from `in_dim` features: the 2H-wide [embedding; hidden] input of the fused
    layer by default, H for the plain layers stacked after it. `qkv_bias`: Qwen2's q/k/v biases (the MTP layer)."""

    def __init__(self, config: LlamaConfig, in_dim: Optional[int] = None, qkv_bias: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = attention_sizes(config)
        in_dim = in_dim or 2 * config.hidden_size
        self.q_proj = nn.Linear(in_dim, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor,
                kv_cache, cache_positions: Optional[torch.Tensor]) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, d)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, d)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        y = cached_attention(q, k, v, kv_cache, cache_positions, attn_mask, self.n_heads // self.n_kv_heads)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FusedInputLayer(nn.Module):
    """The decoder layer fed [embedding; hidden]: EAGLE-3's midlayer, and the first layer of P-EAGLE's stack."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds, hidden, cos, sin, attn_mask, kv_cache, cache_positions):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        h = hidden + self.self_attn(x, cos, sin, attn_mask, kv_cache, cache_positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class PlainLayer(nn.Module):
    """A plain pre-norm Llama decoder layer over the H-wide hidden (the layers stacked after the fused one)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Attention(config, in_dim=config.hidden_size)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden, cos, sin, attn_mask, kv_cache, cache_positions):
        h = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attn_mask, kv_cache, cache_positions)
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftVocabHead(nn.Module):
    """A drafter over a draft vocab mapped to the target's: buffers `d2t` (target id = i + d2t[i]) and `t2d`
    (target id t is in the draft vocab), an `embed_tokens` and an `lm_head` copied from the target."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    d2t: torch.Tensor
    t2d: torch.Tensor

    def add_inputs(self, config: LlamaConfig, train_embeddings: bool) -> int:
        """`config`, `embed_tokens` (frozen unless trained) and `fc` over three target layers; returns H_t."""
        self.config = config
        target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(train_embeddings)
        self.fc = nn.Linear(3 * target_hidden, config.hidden_size, bias=False)
        return target_hidden

    def add_outputs(self, config: LlamaConfig) -> None:
        """The final `norm`, `lm_head` over the draft vocab, the rotary embedding and the vocab map buffers."""
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def init_from_target(self, target_model, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Copy the target's embeddings and its lm_head rows for the draft vocab; set the vocab map."""
        self.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
        used = draft_vocab_ids(d2t)
        self.lm_head.weight.copy_(target_model.get_output_embeddings().weight[used.to(self.lm_head.weight.device)])
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
