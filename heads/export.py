"""`draftsmith export`: write a trained drafter in an engine's format.

The head folder's method (draftsmith.methods, by its config.json `architectures`) loads it and
names its formats. EAGLE-3's:

    format=eagle3       the EAGLE-3 folder vLLM and SGLang load (`LlamaForCausalLMEagle3`, midlayer.*)
    format=speculators  vLLM's own `speculators` format (`Eagle3DraftModel`, layers.0.*,
                        speculators_config with the greedy proposal and the verifier)

Both keep d2t int64 and t2d bool whatever `dtype` the weights are written in.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from omegaconf.errors import MissingMandatoryValue

from draftsmith import DraftsmithError
from draftsmith.data_gen.manifest import MANIFEST, claim_output, owns, prepare_output, read_manifest
from draftsmith.data_gen.target import torch_dtype
from draftsmith.heads.checkpoint import CONFIG, default_aux_layer_ids, head_tensors, llama_layer_config, write_head_folder
from draftsmith.heads.eagle3 import Eagle3Head

SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config schema this writes


@dataclass
class ExportConfig:
    head: str = "???"  # folder written by `draftsmith train` (an EAGLE-3 folder)
    format: str = "eagle3"  # eagle3 | speculators (the formats of the head's method)
    out: Optional[str] = None  # output folder; default: beside the head, `<head>-<format>`
    # speculators: the verifier's HF id or folder (default: the target id in the head's manifest)
    verifier: Optional[str] = None
    speculative_tokens: int = 3  # speculators: the greedy proposal's default length
    dtype: str = "bfloat16"  # dtype of the written weights: bfloat16 | float16 | float32
    include_embeddings: bool = True  # False: engines share the target's embeddings
    overwrite: bool = False  # true: replace an out folder that is not an earlier export (never the head's)

    def __post_init__(self):
        from draftsmith import checks
        from draftsmith.data_gen.target import DTYPES

        if not self.head:
            raise DraftsmithError("export.head is not set: pass head=<folder written by draftsmith train>.")
        from draftsmith.methods import export_formats

        checks.one_of("format", self.format, export_formats())
        checks.at_least("speculative_tokens", self.speculative_tokens, 1)
        checks.one_of("dtype", self.dtype, DTYPES)


# ---------------------------------------------------------------------------------------------
# The speculators format


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
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{
                "proposal_type": "greedy",
                "speculative_tokens": int(speculative_tokens),
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures(verifier)},
        },
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


# ---------------------------------------------------------------------------------------------
# The stage


def is_set(cfg, key: str) -> bool:
    """False for a missing (`???`) or empty option, for OmegaConf and plain dataclass configs alike."""
    try:
        value = getattr(cfg, key)
    except MissingMandatoryValue:
        return False
    return bool(value) and value != "???"


def run(cfg) -> Path:
    """Load the head folder `cfg.head` with its method, write it to `cfg.out` in `cfg.format`, return the path."""
    from draftsmith.methods import method_for_folder

    if not is_set(cfg, "head"):
        raise DraftsmithError("export.head is not set: pass head=<folder written by draftsmith train>.")
    head_dir = Path(cfg.head)
    out = Path(cfg.out) if cfg.out else head_dir.with_name(f"{head_dir.name}-{cfg.format}")
    inputs = [("head", head_dir)] + ([("verifier", cfg.verifier)] if cfg.verifier else [])
    out = prepare_output(out, "export", inputs, overwrite=bool(cfg.overwrite))
    if not head_dir.is_dir():
        raise DraftsmithError(f"head folder {head_dir} does not exist.")
    if not (head_dir / CONFIG).is_file():
        raise DraftsmithError(f"head={str(head_dir)!r} has no {CONFIG}: give the folder written by draftsmith train "
                              f"(its final/).")
    method = method_for_folder(head_dir)
    if cfg.format not in method.formats:
        raise DraftsmithError(f"format={cfg.format} is not a format of {method.name} heads; choose from "
                              f"{', '.join(method.formats)}.")
    drafter = method.load(head_dir)
    target = read_manifest(head_dir).get("target") if (head_dir / MANIFEST).is_file() else None
    if not owns(out, "export"):
        claim_output(out, "export")  # the atomic swap below then replaces only our own folder
    options = ExportOptions(torch_dtype(cfg.dtype), cfg.include_embeddings, cfg.verifier, cfg.speculative_tokens)
    return method.formats[cfg.format](drafter, out, target, options)


def summary(path: Path) -> str:
    return f"draftsmith export: wrote the head to {path}"


@dataclass
class ExportOptions:
    """What a method's format writers read of the export options (dtype already a torch dtype)."""

    dtype: torch.dtype
    include_embeddings: bool
    verifier: Optional[str]
    speculative_tokens: int
