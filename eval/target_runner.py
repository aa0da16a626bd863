"""The target with a static, position-indexed KV cache, driven layer by layer.

The HF model is used unmodified: we call its own `embed_tokens`, `rotary_emb`, decoder layers,
`norm` and `lm_head`, and hand the layers a duck-typed cache whose `update` writes K/V at our
slots and returns the cache up to the last slot in use. Validity is defined by the mask, so
rejected chain slots are never copied or cleared: later steps overwrite them.

    slots      0 ........ start-1 | start ... start+T-1 | (stale, never attended)
    mask       prefix: all True   | new tokens: causal (chain) or ancestors (tree)

`length` (slots [0, length) hold the committed sequence) is the runner's own: its user writes
tokens with `forward`, then says how many are now committed with `commit(length)`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class _LayerKV:
    """What an HF attention layer calls `cache.update(k, v, layer_idx, ...)` on; writes at `start`."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v  # (L, B, n_kv, S, d)
        self.start, self.end = 0, 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states (B, n_kv, T, d) -> slots [start, end)
        self.k[layer_idx, :, :, self.start:self.end] = key_states
        self.v[layer_idx, :, :, self.start:self.end] = value_states
        return self.k[layer_idx, :, :, :self.end], self.v[layer_idx, :, :, :self.end]


class TargetRunner:
    """An HF causal LM (Llama / Qwen2 / Qwen3 families) with one preallocated KV cache.

    Reusable across prompts: `reset()` only forgets the length, nothing is reallocated.
    """

    def __init__(self, model: nn.Module, max_len: int, aux_layer_ids: Optional[list[int]] = None):
        self.model = model.eval()
        self.base = model.model  # the decoder stack (LlamaModel, Qwen2Model, ...)
        cfg = model.config
        self.config = cfg
        self.max_len = int(max_len)
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else None
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        shape = (self.num_layers, 1, cfg.num_key_value_heads, self.max_len, head_dim)
        self.kv = _LayerKV(torch.zeros(shape, dtype=p.dtype, device=p.device),
                           torch.zeros(shape, dtype=p.dtype, device=p.device))
        self._length = 0

    @property
    def length(self) -> int:
        """Slots [0, length) hold the committed sequence."""
        return self._length

    def commit(self, length: int) -> None:
        """Slots [0, length) now hold the committed sequence (written by `forward`, moved by `gather`)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"commit({length}) outside the cache's 0..{self.max_len} slots")
        self._length = length

    def reset(self) -> None:
        self._length = 0

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, start: int,
                attn_mask: Optional[torch.Tensor] = None, logits_rows: str = "all",
                want_aux: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run T new tokens written at slots [start, start+T).

        tokens, positions (T,); attn_mask (T, start+T) bool, True = attend; None = causal by slot
        (valid when slot == position, i.e. chains). logits_rows: "all" | "last" | "none".
        Returns (logits (T or 1, V), aux (T, len(aux_layer_ids)*H) or None).
        """
        T = tokens.numel()
        end = start + T
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} slots > max_len {self.max_len}")
        self.kv.start, self.kv.end = start, end
        mask = self._mask(positions, start, end, attn_mask)
        h = self.base.embed_tokens(tokens[None])  # (1, T, H)
        pos_emb = self.base.rotary_emb(h, position_ids=positions[None])
        aux_ids = self.aux_layer_ids if want_aux else ()
        feats = {}
        for i, layer in enumerate(self.base.layers):
            if i in aux_ids:
                feats[i] = h
            h = layer(h, attention_mask=mask, position_embeddings=pos_emb, position_ids=positions[None],
                      cache=self.kv)
        h = self.base.norm(h)
        feats[self.num_layers] = h  # hidden_states[N] is after the final norm, as in HF
        aux = torch.cat([feats[i] for i in aux_ids], dim=-1)[0] if want_aux else None
        if logits_rows == "none":
            return None, aux
        rows = h[0, -1:] if logits_rows == "last" else h[0]
        return self.model.lm_head(rows), aux

    @staticmethod
    def _mask(positions, start, end, attn_mask):
        if attn_mask is not None:
            return attn_mask[None, None]  # (1, 1, T, S)
        if end - start == 1:
            return None  # one query, every slot up to `end` visible
        slots = torch.arange(end, device=positions.device)
        return (slots[None, :] <= positions[:, None])[None, None]  # (1, 1, T, S)

    def gather(self, src_slots: list[int], dst_start: int) -> None:
        """Move the K/V of `src_slots` (an accepted tree path) to [dst_start, dst_start+len)."""
        if src_slots == list(range(dst_start, dst_start + len(src_slots))):
            return
        src = torch.tensor(src_slots, device=self.device)
        dst = slice(dst_start, dst_start + len(src_slots))
        self.kv.k[:, :, :, dst] = self.kv.k[:, :, :, src]
        self.kv.v[:, :, :, dst] = self.kv.v[:, :, :, src]
