"""The EAGLE-3 drafter: one decoder layer fed by three fused target layers.

Read top to bottom: config -> head. The layer, attention and KV caches are the shared kit's (heads/kit.py:
`FusedInputLayer`, `Attention`, `StaticKVCache`, `ConcatKVCache`). The training-time-test unroll and its attention
are training's (train/eagle3.py).

    fused = fc(cat(aux_hidden_states))                         # (B, T, 3H_t) -> (B, T, H)
    x     = cat(input_layernorm(embed(token)), hidden_norm(h))  # (B, T, 2H), embedding first
    h'    = h + o_proj(attn(q/k/v from x))                      # residual is the un-normed h
    h'    = h' + mlp(post_attention_layernorm(h'))
    logits = lm_head(norm(h'))  over the draft vocab           # h' (PRE-norm) is the next step's h

The EAGLE-3.1 norms, each off by default, exactly as vLLM's `llama_eagle3.py` reads them (config keys of the same
names; `combine_hidden_states` and `LlamaModel.forward` there):

    norm_before_fc   fused = fc(input_norm(cat(aux)))            one RMSNorm over the whole 3H_t   input_norm.weight
    fc_norm          fused = fc(cat(fc_norm[i](aux_i)))          one RMSNorm per target layer, H_t fc_norm.{i}.weight
                     (both on: input_norm first, then fc_norm, as vLLM applies them)
    norm_output      the next step's h is norm(h'), the POST-norm hidden (vLLM: `aux_output = hidden_states if
                     self.norm_output else hidden_prenorm`); the logits are lm_head(norm(h')) either way

The tensor names match the checkpoint format vLLM and SGLang load (`fc`, `midlayer.*`, `norm`, `lm_head`,
`d2t`, `t2d`; `input_norm`, `fc_norm.{i}` with the norms above).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from .kit import DraftVocabHead, FusedInputLayer, draft_config_from_target

# The EAGLE-3.1 norms (see the module docstring): config attributes and config.json keys of the same names
NORMS = ("norm_before_fc", "fc_norm", "norm_output")
NUM_AUX = 3  # the target layers fused by fc (low, middle, high): fc_norm has one RMSNorm for each


def eagle3_config_from_target(target_config, draft_vocab_size: int, norm_before_fc: bool = False,
                              fc_norm: bool = False, norm_output: bool = False) -> LlamaConfig:
    """The head's config: a 1-layer Llama matching the target's width, heads, rope and eps, and the EAGLE-3.1 norms.

    This is also (plus architectures / d2t fields added at save time) the config.json engines read.
    """
    config = draft_config_from_target(target_config, draft_vocab_size)
    config.norm_before_fc, config.fc_norm, config.norm_output = bool(norm_before_fc), bool(fc_norm), bool(norm_output)
    return config


def norms_of(config) -> dict[str, bool]:
    """The EAGLE-3.1 norms a head's config asks for (absent = off: a config built before they existed)."""
    return {name: bool(getattr(config, name, False)) for name in NORMS}


class Eagle3Head(DraftVocabHead):
    """EAGLE-3 drafter. `d2t[i]`: target id = i + d2t[i]; `t2d[t]`: target id t is in the draft vocab."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        target_hidden = self.add_inputs(config, train_embeddings=False)  # embed_tokens: a frozen copy of the target's
        norms = norms_of(config)
        # None (no module, no tensor) when off: such a head has exactly the tensors and initialisation it had before
        self.input_norm = LlamaRMSNorm(NUM_AUX * target_hidden, eps=config.rms_norm_eps) if norms["norm_before_fc"] else None
        self.fc_norm = (nn.ModuleList(LlamaRMSNorm(target_hidden, eps=config.rms_norm_eps) for _ in range(NUM_AUX))
                        if norms["fc_norm"] else None)
        self.norm_output = norms["norm_output"]
        self.midlayer = FusedInputLayer(config)
        self.add_outputs(config)

    def fuse(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, 3H_t) target features -> (B, T, H) step-0 hidden (through input_norm / fc_norm when present)."""
        x = aux_hidden_states.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, x.chunk(NUM_AUX, dim=-1))], dim=-1)
        return self.fc(x)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attn_mask: torch.Tensor, kv_cache=None, cache_positions: Optional[torch.Tensor] = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step.

        input_ids (B, T), hidden (B, T, H) [fused features or the previous step's output],
        position_ids (B, T), attn_mask (B or 1, 1, T, S) bool (True = attend) over the cache's first
        S slots (a StaticKVCache: only the slots in use need to be covered; S = T without a cache). Returns (the
        next step's hidden (B, T, H): pre-norm, post-norm with norm_output; logits (B, T, Vd)).
        """
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        h = self.midlayer(embeds, hidden, cos, sin, attn_mask, kv_cache, cache_positions)
        normed = self.norm(h)
        return (normed if self.norm_output else h), self.lm_head(normed)
