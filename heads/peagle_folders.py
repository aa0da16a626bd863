"""The folders of a P-EAGLE drafter: the one vLLM loads for parallel drafting, and vLLM's speculators format.

    format=peagle       config.json: LlamaForCausalLMEagle3 with num_hidden_layers = the drafter's layers,
                        "parallel_drafting": true, "ptd_token_id" (the mask token id), and every field an
                        EAGLE-3 folder has. model.safetensors: fc, mask_hidden (1, 3H_t), layers.0.* (the
                        EAGLE-3 layer, with hidden_norm), layers.{i}.*, norm, lm_head, d2t (int64), t2d (bool),
                        embed_tokens (always when the embeddings were trained: they are not the target's)
    format=speculators  config.json: PEagleDraftModel, speculators_model_type "peagle", mask_token_id,
                        transformer_layer_config with the layer count, speculators_config (algorithm peagle);
                        the same tensors, mask_hidden shaped (1, 1, 3H_t) as speculators' parameter is

Both are written atomically (heads/folders.py `write_head_folder`); loading reads safetensors only and checks
every tensor's name, shape and dtype.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from ..core import DraftsmithError
from ..core.engine import NUM_SPECULATIVE_TOKENS
from .folders import (CONFIG, EAGLE3_ARCHITECTURE, EMBED, WEIGHTS, build_head,
                                      config_from_json, eagle3_architecture_config, export_writer, folder_hooks,
                                      folder_tensors, layer_shapes, llama_layer_config, read_checked_tensors,
                                      read_config_json, speculators_fields, speculators_writer,
                                      with_target_embeddings, write_head_folder)
from ..core.layers import default_aux_layer_ids
from ..core.method_hooks import FolderHooks
from .peagle import PEagleHead

PEAGLE_SPECULATORS_ARCHITECTURE = "PEagleDraftModel"
MASK = "mask_hidden"
ARCHITECTURES = (EAGLE3_ARCHITECTURE,)  # vLLM's parallel drafting reads EAGLE-3's architecture: `claims` tells ours
FOREIGN_ARCHITECTURES = {PEAGLE_SPECULATORS_ARCHITECTURE: "the speculators format (vLLM loads it); give the P-EAGLE "
                                                          "folder it was exported from"}


def peagle_tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the parallel-drafting folder (embed_tokens included) and its shape, for `config`."""
    H, V, Vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
    H_t = getattr(config, "target_hidden_size", None) or H
    shapes = {"fc.weight": (H, 3 * H_t), MASK: (1, 3 * H_t), "layers.0.hidden_norm.weight": (H,)}
    for i in range(config.num_hidden_layers):
        shapes.update(layer_shapes(config, f"layers.{i}.", 2 * H if i == 0 else H))  # the first reads [embedding; hidden]
    shapes.update({"norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (V,), EMBED: (V, H)})
    return shapes


def peagle_tensors(head: PEagleHead, dtype: Optional[torch.dtype] = None,
                   include_embeddings: bool = True) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the folder's names, contiguous on CPU, floats in `dtype`. Trained
    embeddings are always included (they are no longer the target's)."""
    include_embeddings = include_embeddings or bool(getattr(head.config, "train_embeddings", True))
    return folder_tensors(head, peagle_tensor_shapes(head.config), dtype, include_embeddings)


# ---- format=peagle: the folder vLLM serves with parallel drafting --------------------------------------

def peagle_config_json(head: PEagleHead, manifest_target: Optional[dict], dtype: Optional[torch.dtype]) -> dict:
    out = eagle3_architecture_config(head.config, manifest_target, dtype)
    out["num_hidden_layers"] = head.config.num_hidden_layers
    out["parallel_drafting"] = True
    out["ptd_token_id"] = head.mask_token_id
    out["train_embeddings"] = bool(getattr(head.config, "train_embeddings", True))  # draftsmith's: how it was trained
    if getattr(head.config, "num_depths", None) is not None:  # draftsmith's: eval drafts at most this many tokens
        out["num_depths"] = int(head.config.num_depths)
    return out


def save_peagle(head: PEagleHead, folder: str | os.PathLike, manifest_target: dict | None = None, *,
                include_embeddings: bool = True, dtype: Optional[torch.dtype] = None, stage: str = "train") -> Path:
    """Write the parallel-drafting folder (atomically) and return its path."""
    tensors = peagle_tensors(head, dtype, include_embeddings)
    config = peagle_config_json(head, manifest_target, dtype or head.fc.weight.dtype)
    return write_head_folder(Path(folder), tensors, config, head.config.draft_vocab_size, manifest_target, stage,
                             "peagle")


def is_peagle_folder(config: dict) -> bool:
    """An EAGLE-3-architecture folder that vLLM drafts in parallel (format=peagle)."""
    return bool(config.get("parallel_drafting"))


def load_peagle(folder: str | os.PathLike, device="cpu", dtype: Optional[torch.dtype] = None,
                target_embeddings: torch.Tensor | torch.nn.Embedding | None = None) -> PEagleHead:
    """Load a folder written by `save_peagle` (or any vLLM parallel-drafting EAGLE-3 folder), every tensor
    checked. A folder without embed_tokens needs the target's as `target_embeddings`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DraftsmithError(f"head folder {folder} does not exist.")
    raw = read_config_json(folder)
    if not is_peagle_folder(raw):
        raise DraftsmithError(f"{folder / CONFIG} has no \"parallel_drafting\": true; it is not a P-EAGLE folder.")
    for key in ("ptd_token_id", "num_hidden_layers"):
        if key not in raw:
            raise DraftsmithError(f"{folder / CONFIG} has no {key!r}.")
    config = config_from_json(raw, folder / CONFIG)
    config.num_hidden_layers = int(raw["num_hidden_layers"])
    config.mask_token_id = int(raw["ptd_token_id"])
    config.train_embeddings = bool(raw.get("train_embeddings", True))
    depths = raw.get("num_depths")  # absent in a folder another tool wrote: K is not bounded
    if depths is not None and (not isinstance(depths, int) or isinstance(depths, bool) or depths < 1):
        raise DraftsmithError(f"{folder / CONFIG} has num_depths={depths!r}; it must be a positive integer.")
    config.num_depths = depths
    expected = peagle_tensor_shapes(config)
    tensors = read_checked_tensors(folder / WEIGHTS, expected, optional=(EMBED,))
    return build_head(PEagleHead, config, with_target_embeddings(tensors, expected, folder, target_embeddings),
                      device, dtype)


# ---- format=speculators: vLLM's speculators format, type peagle ----------------------------------------

def speculators_peagle_config_json(head: PEagleHead, verifier: Optional[str], num_speculative_tokens: int,
                                   manifest_target: Optional[dict], dtype: torch.dtype) -> dict:
    """config.json for speculators' PEagleSpeculatorConfig (our layer: raw-h residual, no extra norms)."""
    config = head.config
    layer = {**llama_layer_config(config), "num_hidden_layers": config.num_hidden_layers,
             "architectures": ["LlamaForCausalLM"]}
    return speculators_fields(config, PEAGLE_SPECULATORS_ARCHITECTURE, "peagle", layer, verifier, num_speculative_tokens,
                              manifest_target, dtype, bool(getattr(config, "train_embeddings", True)),
                              extra={"mask_token_id": head.mask_token_id})


def save_speculators_peagle(head: PEagleHead, folder: str | os.PathLike, verifier: Optional[str] = None,
                            num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS, manifest_target: dict | None = None,
                            dtype: Optional[torch.dtype] = None, include_embeddings: bool = True) -> Path:
    """Write the drafter in speculators' P-EAGLE format (atomically) and return the folder."""
    if num_speculative_tokens < 1:
        raise DraftsmithError(f"export.num_speculative_tokens={num_speculative_tokens} must be at least 1.")
    dtype = dtype or head.fc.weight.dtype
    tensors = peagle_tensors(head, dtype, include_embeddings)
    tensors[MASK] = tensors[MASK][None]  # (1, 1, 3H_t): speculators' parameter shape
    config = speculators_peagle_config_json(head, verifier, num_speculative_tokens, manifest_target, dtype)
    return write_head_folder(Path(folder), tensors, config, head.config.draft_vocab_size, manifest_target, "export",
                             "speculators")


# ---- the method table's hooks (draftsmith.core.methods) -------------------------------------------------------------------

load, save = folder_hooks(load_peagle, save_peagle)
# formats other methods have that this one cannot be written in: export says why in one sentence
UNSERVED_FORMATS = {"gguf": "llama.cpp has no P-EAGLE loader (no parallel-drafting graph in its tree); export "
                            "format=peagle and serve it with vLLM"}
FORMATS = {"peagle": export_writer(save_peagle), "speculators": speculators_writer(save_speculators_peagle)}


def card(options: dict, formats: list[str], commands: dict) -> dict:
    """P-EAGLE's parts of the card: what it is, tags, the vLLM command, files (`options`: the training run's method
    options, its defaults filled in by publish; `commands`: the engines' serving commands)."""
    return {
        "title": "A P-EAGLE (parallel drafting) head",
        "method": (f"P-EAGLE: an EAGLE-3-style drafter with {options['num_layers']} decoder layers, fed "
                   "by the target's hidden states from three layers, that drafts all K tokens in one forward: the "
                   "positions after the last accepted one take a mask token and a learned `mask_hidden` vector in "
                   "place of target features. Trained with depth sampling (depth d kept for a fraction "
                   f"max({options['down_sample_ratio']}^d, {options['down_sample_ratio_min']}) "
                   f"of the positions, {options['depths']} depths) on the target's own answers; it drafts "
                   "over a reduced vocabulary mapped to the target's by `d2t` / `t2d`."),
        "tags": ["peagle", "eagle3", "parallel-drafting", "speculative-decoding", "draft-model", "draftsmith", "vllm"]
                + (["speculators"] if "speculators" in formats else []),
        "commands": dict(commands),
        "no_sglang": "SGLang has no parallel drafting for EAGLE heads: serve this head with vLLM.",
        "files": {"peagle": "vLLM `LlamaForCausalLMEagle3` with parallel_drafting, ptd_token_id and mask_hidden",
                  "speculators": "vLLM `PEagleDraftModel`, speculators_config (algorithm peagle)"},
        "draft_vocab_size": options.get("draft_vocab_size"),
    }


HOOKS = FolderHooks(architectures=ARCHITECTURES, formats=FORMATS, load=load, save=save, card=card,
                    claims=is_peagle_folder,  # EAGLE-3's architecture, with "parallel_drafting": true
                    foreign_architectures=FOREIGN_ARCHITECTURES, unserved_formats=UNSERVED_FORMATS,
                    # the target layers it reads (low, middle, high), captured by data-gen and computed by train /
                    # eval's runner
                    aux_layer_ids=default_aux_layer_ids)
