"""A target's own multi-token-prediction (MTP) layer, MiMo's, as vLLM 0.32 computes it (`mimo_mtp.py`).

One MTP step at position p reads the target's hidden state h_p and the next token x_{p+1} and predicts x_{p+2}:

    e     = embed(x_{p+1}), zeroed at position 0            # vLLM: "masking inputs at position 0"
    x     = input_proj(cat(hidden_layernorm(h_p), token_layernorm(e)))   # (B, T, 2H) -> (B, T, H), hidden FIRST
    h'    = x + o_proj(attn(input_layernorm(x)))            # a Qwen2 decoder layer: q/k/v with biases
    h'    = h' + mlp(post_attention_layernorm(h'))
    out   = final_layernorm(h')                             # the logits are the target's lm_head(out)

`out` is also the next step's h (vLLM's MiMoMTP returns one tensor, used for both). vLLM serves only the first
MTP layer (`spec_step_idx == 0`), recursively for every drafted token; so does draftsmith.

Which hidden state of the target the first step reads, and the order of the fusion, are the engine's choice per
architecture (heads/mtp_folders.py ENGINE_INPUTS). MiMo: the last decoder layer's output BEFORE the final norm
(`mimo.py:87`), hidden first. The two are config fields (`mtp_hidden`, `mtp_fusion`) so that a layer is always
computed as the engine that serves it computes it, and a test can compute it otherwise (a negative control).

The target's embeddings and lm_head are the target's own, never copies: `MTPDrafter` holds only the MTP layers
(what is trained and saved); `attach(target_model)` lends it the target's modules for drafting.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import Qwen2Config
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from ..core import DraftsmithError
from .kit import Attention

HIDDEN_INPUTS = ("pre_norm", "post_norm")  # the target's last hidden state before / after its final norm
FUSIONS = ("hidden_first", "embedding_first")  # input_proj(cat(h, e)) (MiMo) | input_proj(cat(e, h)) (DeepSeek, Qwen)
MTP_FIELDS = ("num_nextn_predict_layers", "mtp_hidden", "mtp_fusion")  # what an MTP config adds to the target's


def mtp_config_from_target(target_config, num_layers: int = 1, hidden: str = "pre_norm",
                           fusion: str = "hidden_first") -> Qwen2Config:
    """The MTP layers' config: a Qwen2 config of the target's width, heads, rope and eps (vLLM builds the MTP
    block as a Qwen2DecoderLayer from the target's own config), with the MTP fields."""
    if hidden not in HIDDEN_INPUTS:
        raise DraftsmithError(f"mtp_hidden={hidden!r} is not one of {', '.join(HIDDEN_INPUTS)}.")
    if fusion not in FUSIONS:
        raise DraftsmithError(f"mtp_fusion={fusion!r} is not one of {', '.join(FUSIONS)}.")
    H, heads = target_config.hidden_size, target_config.num_attention_heads
    head_dim = getattr(target_config, "head_dim", None) or H // heads
    if head_dim * heads != H:  # vLLM's Qwen2Attention computes head_dim = hidden_size // num_heads
        raise DraftsmithError(f"the target's head_dim {head_dim} x {heads} heads is not its hidden size {H}: "
                              f"a Qwen2-shaped MTP layer (vLLM's MiMo) cannot be built for it.")
    rope = getattr(target_config, "rope_parameters", None) or {
        "rope_type": "default", "rope_theta": getattr(target_config, "rope_theta", 10000.0)}
    config = Qwen2Config(
        vocab_size=target_config.vocab_size, hidden_size=H, intermediate_size=target_config.intermediate_size,
        num_hidden_layers=target_config.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=target_config.num_key_value_heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps, hidden_act=getattr(target_config, "hidden_act", "silu"),
        rope_parameters=dict(rope), tie_word_embeddings=False)
    config.head_dim = head_dim
    config.mlp_bias = False  # LlamaMLP reads it; a Qwen2 MLP has no biases
    config.num_nextn_predict_layers = int(num_layers)
    config.mtp_hidden, config.mtp_fusion = hidden, fusion
    config.target_architecture = (getattr(target_config, "architectures", None) or [None])[0]
    return config


class MTPLayer(nn.Module):
    """One MTP layer; its parameter names are the checkpoint's under `model.mtp_layers.{i}.`."""

    def __init__(self, config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.fusion = config.mtp_fusion
        self.token_layernorm = LlamaRMSNorm(H, eps=eps)
        self.hidden_layernorm = LlamaRMSNorm(H, eps=eps)
        self.input_proj = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)
        self.self_attn = Attention(config, in_dim=config.hidden_size, qkv_bias=True)  # Qwen2's: q/k/v biases
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)
        self.mlp = LlamaMLP(config)
        self.final_layernorm = LlamaRMSNorm(H, eps=eps)

    def forward(self, embeds, hidden, positions, cos, sin, attn_mask, kv_cache=None, cache_positions=None):
        """embeds, hidden (B, T, H); positions (B, T) -> the step's output (B, T, H), after final_layernorm."""
        embeds = torch.where(positions[..., None] == 0, 0, embeds)  # vLLM zeroes the token input at position 0
        e, h = self.token_layernorm(embeds), self.hidden_layernorm(hidden)
        fused = torch.cat([h, e] if self.fusion == "hidden_first" else [e, h], dim=-1)  # (B, T, 2H)
        x = self.input_proj(fused)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, kv_cache, cache_positions)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.final_layernorm(x)


class MTPDrafter(nn.Module):
    """The target's MTP layers (only these are trained and saved) and, once attached, the target's embeddings and
    lm_head, lent, not owned (they are not in this module's parameters or state_dict)."""

    def __init__(self, config):
        super().__init__()
        for field in MTP_FIELDS:
            if not hasattr(config, field):
                raise DraftsmithError(f"an MTP config needs {field!r} (heads/mtp.py mtp_config_from_target).")
        self.config = config
        self.layers = nn.ModuleList(MTPLayer(config) for _ in range(config.num_nextn_predict_layers))
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self._target: tuple = ()  # (embed_tokens, lm_head, final norm) of the target, when attached

    def attach(self, target_model) -> "MTPDrafter":
        """Lend the drafter the target's embeddings, lm_head and final norm (a plain tuple: never registered, so
        never trained, moved or saved with it)."""
        if target_model.config.hidden_size != self.config.hidden_size:
            raise DraftsmithError(f"the MTP layer is {self.config.hidden_size} wide, the target "
                                  f"{target_model.config.hidden_size}: it was made for another target.")
        if target_model.config.vocab_size != self.config.vocab_size:
            raise DraftsmithError(f"the MTP layer's config has vocab_size {self.config.vocab_size}, the target "
                                  f"{target_model.config.vocab_size}: it was made for another target.")
        norm = target_model.model.norm
        # checked once here, not in every step (a host sync on an accelerator)
        if self.config.mtp_hidden == "pre_norm" and bool((norm.weight == 0).any()):
            raise DraftsmithError("the target's final norm has a zero weight: its pre-norm hidden state cannot be "
                                  "read from hidden_states[N] (heads/mtp.py MTPDrafter.engine_hidden).")
        self._target = (target_model.get_input_embeddings(), target_model.get_output_embeddings(), norm)
        return self

    def _lent(self) -> tuple:
        if not self._target:
            raise DraftsmithError("the MTP drafter has no target attached (MTPDrafter.attach(target_model)).")
        return self._target

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._lent()[0](input_ids)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The target's lm_head over a step's output (already final_layernorm'd), in the lm_head's dtype (training keeps
        the layer in fp32 beside a bf16 target)."""
        head = self._lent()[1]
        return head(out.to(head.weight.dtype))

    def engine_hidden(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target hidden state the first step reads, from the target's hidden_states[N] (after its final norm,
        what every stage computes and captures): as is (post_norm: DeepSeek, Qwen in vLLM), or the last layer's
        output before that norm (pre_norm: MiMo in vLLM, `mimo.py:87`). The step reads h only through
        hidden_layernorm, which is blind to h's scale, and norm(h) = h / rms(h) * w: so h_N / w is the pre-norm state
        up to its scale, and the step computes what it computes on the pre-norm state but for the norms' eps: a relative
        eps / (2 mean(h^2)), 5e-7 for a unit-scale state at eps 1e-6 (a trained target's last state is larger)."""
        if self.config.mtp_hidden == "post_norm":
            return last_hidden
        return last_hidden / self._lent()[2].weight.to(last_hidden.dtype)  # attach refused a zero weight

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attn_mask: torch.Tensor, kv_cache=None, cache_positions: Optional[torch.Tensor] = None,
                layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of MTP layer `layer`: input_ids (B, T) (x_{p+1}), hidden (B, T, H) (the target's h_p as
        `engine_hidden` gives it, or the previous step's output), positions (B, T) (p), attn_mask (B|1, 1, T, S) bool
        over the cache's first S slots (S = T without a cache). Returns (the step's output (B, T, H): the next
        step's hidden; logits (B, T, V))."""
        embeds = self.embed(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, positions)
        out = self.layers[layer](embeds, hidden, positions, cos, sin, attn_mask, kv_cache, cache_positions)
        return out, self.logits(out)


@torch.no_grad()
def init_mtp_layer(layer: MTPLayer, std: float = 0.02, generator: Optional[torch.Generator] = None) -> MTPLayer:
    """A fresh layer: linear weights ~ N(0, std), biases zero, norms one (HF's initialisation of a Qwen2 layer)."""
    for module in layer.modules():
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std, generator=generator)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, LlamaRMSNorm):
            module.weight.fill_(1.0)
    return layer
