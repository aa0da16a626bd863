"""vLLM's `speculators` format of an EAGLE-3 head (`Eagle3DraftModel`, layers.0.*, speculators_config
with the greedy proposal and the verifier). d2t stays int64 and t2d bool whatever the weights' dtype."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from draftsmith import DraftsmithError
from draftsmith.heads.checkpoint import CONFIG, default_aux_layer_ids, head_tensors, llama_layer_config, write_head_folder
from draftsmith.heads.eagle3 import Eagle3Head

SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config schema this writes



def speculators_name(name: str) -> str:
    """EAGLE-3 folder name -> speculators name: the decoder layer is `layers.0`, not `midlayer`."""
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def verifier_architectures(verifier: Optional[str]) -> list[str]:
    """The verifier's `architectures`, read from its config.json when it is a local folder."""
    path = Path(verifier) / CONFIG if verifier else None
    if path is not None and path.is_file():
        return list(json.loads(path.read_text()).get("architectures") or [])
    return []


def speculators_config_json(head: Eagle3Head, verifier: Optional[str], speculative_tokens: int,
                            manifest_target: Optional[dict], dtype: torch.dtype) -> dict:
    """config.json of the speculators format for our architecture (no extra norms, raw-h residual)."""
    config = head.config
    aux = (manifest_target or {}).get("aux_layer_ids")
    num_layers = (manifest_target or {}).get("num_layers")
    if aux is None and num_layers is not None:
        aux = default_aux_layer_ids(int(num_layers))
    layer = llama_layer_config(config)
    layer["architectures"] = ["LlamaForCausalLM"]
    target_hidden = getattr(config, "target_hidden_size", None)
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": target_hidden if target_hidden and target_hidden != config.hidden_size else None,
        # speculators uses HF hidden_states indices, as we do (2, N//2, N-3 by default)
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in aux] if aux is not None else None,
        # What our layer does: residual = un-normed h, no norm on the fused features, pre-norm h fed back.
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "speculators_config": speculators_config("eagle3", verifier, speculative_tokens),
    }


def speculators_config(algorithm: str, verifier: Optional[str], speculative_tokens: int) -> dict:
    """The `speculators_config` block: the greedy proposal of `speculative_tokens` and the verifier."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [{
            "proposal_type": "greedy",
            "speculative_tokens": int(speculative_tokens),
            "verifier_accept_k": 1,
            "accept_tolerance": 0.0,
        }],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": verifier_architectures(verifier)},
    }


def save_speculators(head: Eagle3Head, folder: str | os.PathLike, verifier: Optional[str] = None,
                     speculative_tokens: int = 3, manifest_target: dict | None = None,
                     dtype: Optional[torch.dtype] = None, include_embeddings: bool = True) -> Path:
    """Write the head in vLLM's speculators format (atomically) and return the folder."""
    if speculative_tokens < 1:
        raise DraftsmithError(f"export.speculative_tokens={speculative_tokens} must be at least 1.")
    folder = Path(folder)
    dtype = dtype or head.fc.weight.dtype
    tensors = {speculators_name(n): t for n, t in head_tensors(head, dtype, include_embeddings).items()}
    config = speculators_config_json(head, verifier, speculative_tokens, manifest_target, dtype)
    return write_head_folder(folder, tensors, config, head.config.draft_vocab_size, manifest_target, "export",
                             "speculators")
