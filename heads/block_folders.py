"""What the block drafters' folders share (heads/dflash_folders.py, heads/dspark_folders.py): the backbone's tensors
and shapes, the Qwen3 layer fields and the DFlash config.json fields vLLM reads (the target layers always written
explicitly: without them vLLM sizes fc as num_hidden_layers * H_t), reading them back, and what both need of
llama.cpp's converter for `export format=gguf` (GGUF_CONVERTER_ARCHITECTURE, check_gguf_vocab)."""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Callable, Optional, TypeVar

import torch

from ..core import DraftsmithError
from .block import DFlashHead, dflash_config_from_target
from .folders import (CONFIG, EMBED, SPECULATORS_VERSION, WEIGHTS, layer_shapes, llama_layer_config,
                                      read_checked_tensors, read_config_json, speculators_config,
                                      write_head_folder)
from .kit import DEFAULT_ROPE_THETA

DFLASH_SPECULATORS_ARCHITECTURE = "DFlashSpeculator"  # speculators' DFlash class; DSpark's config builds on it
DFLASH_ARCHITECTURE = "DFlashDraftModel"  # vLLM's registry: qwen3_dflash.DFlashQwen3ForCausalLM

# format=gguf of both block drafters: the architecture that sends a folder to llama.cpp's DSpark converter
# (conversion/qwen.py DSparkModel), the one of its block converters that maps a reduced draft vocabulary: it writes
# `d2t` as absolute target ids and reads draft_vocab_size. Its plain DFlash converter (DFlashModel) maps no d2t.
GGUF_CONVERTER_ARCHITECTURE = "DSparkDraftModel"


def dflash_tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the DFlash folder (embed_tokens and d2t included) and its shape, for `config`."""
    H, V, Vd, d = config.hidden_size, config.vocab_size, config.draft_vocab_size, config.head_dim
    H_t = getattr(config, "target_hidden_size", None) or H
    shapes = {"fc.weight": (H, 3 * H_t), "hidden_norm.weight": (H,)}
    for i in range(config.num_hidden_layers):
        shapes.update(layer_shapes(config, f"layers.{i}.", H))
        shapes.update({f"layers.{i}.self_attn.q_norm.weight": (d,), f"layers.{i}.self_attn.k_norm.weight": (d,)})
    shapes.update({"norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (V,), EMBED: (V, H)})
    return shapes


def layer_fields(config, dtype: Optional[torch.dtype]) -> dict:
    """The Qwen3 config fields of the drafter's layers (sizes, heads, rope, eps, the layer count, all full
    attention so that vLLM runs every layer non-causally)."""
    fields = llama_layer_config(config, dtype)
    fields.pop("rope_scaling", None)  # Qwen3Config reads rope_parameters
    n = config.num_hidden_layers
    return {**fields, "model_type": "qwen3", "num_hidden_layers": n, "layer_types": ["full_attention"] * n,
            "use_sliding_window": False}


def dflash_config_json(head: DFlashHead, dtype: Optional[torch.dtype], architecture: str) -> dict:
    """The block drafter's config.json fields as vLLM's DFlash folder holds them, under `architecture`."""
    config = head.config
    aux = [int(i) for i in config.aux_layer_ids]
    out = {"architectures": [architecture], **layer_fields(config, dtype),
           "draft_vocab_size": config.draft_vocab_size,
           "block_size": config.block_size,
           "eagle_aux_hidden_state_layer_ids": aux,
           "dflash_config": {"mask_token_id": head.mask_token_id, "target_layer_ids": [i - 1 for i in aux],
                             "causal": False, "use_aux_hidden_state": True}}
    target_hidden = getattr(config, "target_hidden_size", None)
    if target_hidden and target_hidden != config.hidden_size:
        out["target_hidden_size"] = target_hidden
    return out


def int_list(raw, key: str, where: Path) -> list[int]:
    if not isinstance(raw, list) or not raw or not all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
        raise DraftsmithError(f"{where} has {key}={raw!r}; expected a non-empty list of integers.")
    return list(raw)


def dflash_config_from_json(raw: dict, where: Path, architecture: str):
    """The block drafter's config from a config.json written by `dflash_config_json` under `architecture` (refused,
    naming the field, when one is missing)."""
    if architecture not in (raw.get("architectures") or []):
        raise DraftsmithError(f"{where} declares architectures {raw.get('architectures')!r}, "
                              f"not [{architecture!r}].")
    required = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "rms_norm_eps", "max_position_embeddings", "num_hidden_layers", "block_size")
    for key in required:
        if key not in raw:
            raise DraftsmithError(f"{where} has no {key!r}.")
    dflash = raw.get("dflash_config")
    if not isinstance(dflash, dict) or "mask_token_id" not in dflash:
        raise DraftsmithError(f"{where} has no dflash_config.mask_token_id.")
    if raw.get("eagle_aux_hidden_state_layer_ids") is not None:
        aux = int_list(raw["eagle_aux_hidden_state_layer_ids"], "eagle_aux_hidden_state_layer_ids", where)
    elif dflash.get("target_layer_ids") is not None:  # DFlash's convention: the output of layer i
        aux = [i + 1 for i in int_list(dflash["target_layer_ids"], "dflash_config.target_layer_ids", where)]
    else:
        raise DraftsmithError(f"{where} names no target layers (eagle_aux_hidden_state_layer_ids or "
                              f"dflash_config.target_layer_ids).")
    if len(aux) != 3:
        raise DraftsmithError(f"{where} reads {len(aux)} target layers {aux}; draftsmith's DFlash drafter reads 3.")
    if dflash.get("causal") or raw.get("is_causal"):
        raise DraftsmithError(f"{where} asks for causal attention; draftsmith's DFlash drafter is non-causal.")
    fields = {k: raw[k] for k in required if k not in ("num_hidden_layers", "block_size")}
    fields["head_dim"] = raw.get("head_dim")
    fields["hidden_act"] = raw.get("hidden_act", "silu")
    fields["rope_parameters"] = raw.get("rope_parameters") or {"rope_type": "default",
                                                               "rope_theta": raw.get("rope_theta", DEFAULT_ROPE_THETA)}
    config = dflash_config_from_target(types.SimpleNamespace(**fields), raw.get("draft_vocab_size", raw["vocab_size"]),
                                       raw["num_hidden_layers"], raw["block_size"], dflash["mask_token_id"], aux)
    config.target_hidden_size = raw.get("target_hidden_size") or raw["hidden_size"]
    return config


def read_dflash_folder(folder: Path):
    """(config, tensors) of a DFlash folder written by draftsmith (heads/dflash_folders.py), every tensor checked;
    embed_tokens may be absent (the target's then), and d2t of a full-vocab folder (the identity map, filled in).
    DFlash's loader and DSpark's warm start (train/dspark.py) read it."""
    if not folder.is_dir():
        raise DraftsmithError(f"head folder {folder} does not exist.")
    config = dflash_config_from_json(read_config_json(folder), folder / CONFIG, DFLASH_ARCHITECTURE)
    full_vocab = config.draft_vocab_size == config.vocab_size
    tensors = read_checked_tensors(folder / WEIGHTS, dflash_tensor_shapes(config),
                                   optional=(EMBED,) + (("d2t",) if full_vocab else ()))
    if full_vocab:
        tensors.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
    return config, tensors


BlockHead = TypeVar("BlockHead", bound=DFlashHead)  # DFlash's head or DSpark's (which extends it)


def check_target_layers(head: BlockHead, folder, target=None) -> BlockHead:
    """A block drafter's folder beside a target: the target layers it reads must be the ones the target computes."""
    if target is not None and list(head.config.aux_layer_ids) != list(target.aux_layer_ids):
        raise DraftsmithError(f"{Path(folder) / CONFIG} reads target layers {head.config.aux_layer_ids} "
                              f"(HF hidden_states indices), but the target computes {list(target.aux_layer_ids)}: pass "
                              f"target.aux_layer_ids={head.config.aux_layer_ids}.")
    return head


def check_gguf_vocab(config, method: str) -> None:
    """format=gguf needs a reduced draft vocabulary: llama.cpp's DSpark converter drops the drafter's own lm_head
    when draft_vocab_size equals the target's vocab (conversion/qwen.py DSparkModel.modify_tensors), and llama.cpp
    then computes the logits with the drafter's embeddings or the target's output (src/models/dflash.cpp), not the
    trained lm_head."""
    if config.draft_vocab_size == config.vocab_size:
        raise DraftsmithError(f"format=gguf: this {method} drafter drafts over the target's whole vocabulary "
                              f"({config.vocab_size} tokens), and llama.cpp's DSpark converter then drops its trained "
                              f"lm_head for the target's output; train it with method.draft_vocab_size below "
                              f"{config.vocab_size}.")


# ---- speculators' DFlash config: DFlash's format=speculators, and the base of DSpark's ---------------------------

def speculators_dflash_config_json(head: DFlashHead, verifier: Optional[str], num_speculative_tokens: int,
                                   dtype: torch.dtype) -> dict:
    config = head.config
    target_hidden = getattr(config, "target_hidden_size", None)
    layer = {**layer_fields(config, None), "architectures": ["Qwen3ForCausalLM"]}
    return {
        "architectures": [DFLASH_SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "block_size": config.block_size,
        "target_hidden_size": target_hidden if target_hidden and target_hidden != config.hidden_size else None,
        "aux_hidden_state_layer_ids": [int(i) for i in config.aux_layer_ids],  # HF indices, as speculators'
        "mask_token_id": head.mask_token_id,
        # vLLM maps this to dflash_config.causal = not it, for every layer: true keeps our non-causal attention
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "speculators_config": speculators_config("dflash", verifier, num_speculative_tokens),
    }


def save_speculators_block(head: DFlashHead, folder: str | os.PathLike, tensors: Callable[..., dict],
                           config_json: Callable[..., dict], verifier: Optional[str],
                           num_speculative_tokens: Optional[int], manifest_target: dict | None,
                           dtype: Optional[torch.dtype], include_embeddings: bool) -> Path:
    """Write a block drafter in speculators' format (atomically): `tensors(head, dtype, include_embeddings)` under
    `config_json(head, verifier, K, dtype)`; K defaults to block_size - 1 (DFlash's and DSpark's writers called
    directly; export and publish always pass theirs, NUM_SPECULATIVE_TOKENS unless told)."""
    if num_speculative_tokens is None:
        num_speculative_tokens = head.block_size - 1
    if num_speculative_tokens < 1:
        raise DraftsmithError(f"export num_speculative_tokens={num_speculative_tokens} must be at least 1.")
    dtype = dtype or head.fc.weight.dtype
    return write_head_folder(Path(folder), tensors(head, dtype, include_embeddings),
                             config_json(head, verifier, num_speculative_tokens, dtype), head.config.draft_vocab_size,
                             manifest_target, "export", "speculators")
