"""The EAGLE-3 folders: the one vLLM and SGLang load as a drafter, and vLLM's speculators format.

    format=eagle3       config.json: LlamaForCausalLMEagle3, 1 layer, draft_vocab_size, target-matching sizes;
                        model.safetensors: fc, midlayer.*, norm, lm_head, d2t (int64), t2d (bool) [, embed_tokens]
    format=speculators  config.json: Eagle3DraftModel, layers.0.* instead of midlayer.*, speculators_config with the
                        greedy proposal and the verifier

The EAGLE-3.1 norms (heads/eagle3.py) a head has are written only when on, under the names vLLM 0.32.0's
`llama_eagle3.py` reads: config.json `norm_before_fc` / `fc_norm` / `norm_output` true at the top level, tensors
`input_norm.weight` [3H_t] and `fc_norm.{i}.weight` [H_t] (`model.` + these names in vLLM); the speculators format
writes the same flags and tensor names (speculators 0.9's `Eagle3SpeculatorConfig` and `Eagle3DraftModel`).
Loading reads them back as vLLM does: `norm_before_fc` from `eagle_config` when it has it, else the top level.

Both are written atomically (heads/folders.py `write_head_folder`); loading reads safetensors only and checks every
tensor's name, shape and dtype.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from ..core import DraftsmithError
from ..core.engine import NUM_SPECULATIVE_TOKENS
from .eagle3 import NUM_AUX, Eagle3Head, norms_of
from .folders import (CONFIG, EAGLE3_ARCHITECTURE, EMBED, WEIGHTS, build_head,
                                      config_from_json, eagle3_architecture_config, export_writer, folder_hooks,
                                      folder_tensors, gguf_writer, layer_shapes, llama_layer_config, read_checked_tensors,
                                      read_config_json, speculators_fields, speculators_writer,
                                      with_target_embeddings, write_head_folder)
from ..core.layers import default_aux_layer_ids
from ..core.method_hooks import FolderHooks

SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"
ARCHITECTURES = (EAGLE3_ARCHITECTURE,)
FOREIGN_ARCHITECTURES = {SPECULATORS_ARCHITECTURE: "the speculators format (vLLM loads it); give the EAGLE-3 folder it "
                                                   "was exported from"}


def eagle3_tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the EAGLE-3 folder (embed_tokens included) and its shape, for `config`."""
    H, V, Vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
    H_t = getattr(config, "target_hidden_size", None) or H
    norms = norms_of(config)
    return {
        "fc.weight": (H, NUM_AUX * H_t),
        **({"input_norm.weight": (NUM_AUX * H_t,)} if norms["norm_before_fc"] else {}),
        **({f"fc_norm.{i}.weight": (H_t,) for i in range(NUM_AUX)} if norms["fc_norm"] else {}),
        "midlayer.hidden_norm.weight": (H,),
        **layer_shapes(config, "midlayer.", 2 * H),  # q/k/v read [embedding; hidden]
        "norm.weight": (H,),
        "lm_head.weight": (Vd, H),
        "d2t": (Vd,),
        "t2d": (V,),
        EMBED: (V, H),
    }


def head_tensors(head: Eagle3Head, dtype: Optional[torch.dtype] = None,
                 include_embeddings: bool = True) -> dict[str, torch.Tensor]:
    """The head's tensors under the EAGLE-3 folder's names, contiguous on CPU, floats in `dtype`."""
    return folder_tensors(head, eagle3_tensor_shapes(head.config), dtype, include_embeddings)


# ---- format=eagle3 -----------------------------------------------------------------------------------

def save_eagle3(head: Eagle3Head, folder: str | os.PathLike, manifest_target: dict | None = None,
                extra_config: dict | None = None, *, include_embeddings: bool = True,
                dtype: Optional[torch.dtype] = None, stage: str = "train") -> Path:
    """Write the EAGLE-3 folder vLLM and SGLang load (atomically) and return its path.

    `manifest_target` (a `Target.identity()`) adds manifest.json and, when not the default,
    the aux-layer ids; `extra_config` adds keys to config.json; `dtype` casts the float tensors.
    """
    folder = Path(folder)
    tensors = head_tensors(head, dtype, include_embeddings)
    config = eagle3_architecture_config(head.config, manifest_target, dtype or head.fc.weight.dtype)
    config.update({name: True for name, on in norms_of(head.config).items() if on})  # vLLM's defaults are false
    config.update(extra_config or {})
    return write_head_folder(folder, tensors, config, head.config.draft_vocab_size, manifest_target, stage, "eagle3")


def load_eagle3(folder: str | os.PathLike, device="cpu", dtype: Optional[torch.dtype] = None,
                target_embeddings: torch.Tensor | torch.nn.Embedding | None = None) -> Eagle3Head:
    """Load an EAGLE-3 folder written by `save_eagle3` (or any engine-format EAGLE-3 folder).

    Every tensor's name, shape and dtype is checked. A folder without `embed_tokens.weight`
    needs the target's embeddings as `target_embeddings` (V, H). `dtype` None keeps the file's.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DraftsmithError(f"head folder {folder} does not exist.")
    fields = read_config_json(folder)
    config = config_from_json(fields, folder / CONFIG)
    for name, on in norms_in_json(fields).items():
        setattr(config, name, on)
    expected = eagle3_tensor_shapes(config)
    tensors = read_checked_tensors(folder / WEIGHTS, expected, optional=(EMBED,))
    head = build_head(Eagle3Head, config, with_target_embeddings(tensors, expected, folder, target_embeddings),
                      device, dtype)
    head.embed_tokens.weight.requires_grad_(False)
    return head


def norms_in_json(config: dict) -> dict[str, bool]:
    """The EAGLE-3.1 norms an EAGLE-3 config.json asks for, read as vLLM's `llama_eagle3.py` reads them:
    `eagle_config["norm_before_fc"]` when present, else the top-level key; `fc_norm`, `norm_output` at the top."""
    eagle_config = config.get("eagle_config") or {}
    return {"norm_before_fc": bool(eagle_config.get("norm_before_fc", config.get("norm_before_fc", False))),
            "fc_norm": bool(config.get("fc_norm", False)), "norm_output": bool(config.get("norm_output", False))}


# ---- format=speculators -----------------------------------------------------------------------------

def speculators_name(name: str) -> str:
    """EAGLE-3 folder name -> speculators name: the decoder layer is `layers.0`, not `midlayer`."""
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def speculators_config_json(head: Eagle3Head, verifier: Optional[str], num_speculative_tokens: int,
                            manifest_target: Optional[dict], dtype: torch.dtype) -> dict:
    """config.json of the speculators format for our architecture (raw-h residual, the head's EAGLE-3.1 norms)."""
    layer = llama_layer_config(head.config)
    layer["architectures"] = ["LlamaForCausalLM"]
    return speculators_fields(head.config, SPECULATORS_ARCHITECTURE, "eagle3", layer, verifier, num_speculative_tokens,
                              manifest_target, dtype, embed_requires_grad=False, norms=norms_of(head.config))


def save_speculators(head: Eagle3Head, folder: str | os.PathLike, verifier: Optional[str] = None,
                     num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS, manifest_target: dict | None = None,
                     dtype: Optional[torch.dtype] = None, include_embeddings: bool = True) -> Path:
    """Write the head in vLLM's speculators format (atomically) and return the folder."""
    if num_speculative_tokens < 1:
        raise DraftsmithError(f"export.num_speculative_tokens={num_speculative_tokens} must be at least 1.")
    norms = norms_of(head.config)
    if norms["norm_before_fc"] and norms["fc_norm"]:
        raise DraftsmithError("format=speculators cannot hold this head: it has both norm_before_fc and fc_norm, which "
                              "speculators 0.9's Eagle3SpeculatorConfig refuses together; export format=eagle3, where "
                              "vLLM applies both.")
    folder = Path(folder)
    dtype = dtype or head.fc.weight.dtype
    tensors = {speculators_name(n): t for n, t in head_tensors(head, dtype, include_embeddings).items()}
    config = speculators_config_json(head, verifier, num_speculative_tokens, manifest_target, dtype)
    return write_head_folder(folder, tensors, config, head.config.draft_vocab_size, manifest_target, "export",
                             "speculators")


# ---- format=gguf (llama.cpp) --------------------------------------------------------------------------

def eagle3_for_gguf(head: Eagle3Head, folder: Path, manifest_target: Optional[dict], options) -> Path:
    """The EAGLE-3 folder as llama.cpp's converter reads it: the aux-layer ids always written (it reads them at the
    top level, HF hidden_states indices: llama.cpp captures each layer's input), the EAGLE-3.1 norms it has no
    tensor for refused."""
    unserved = [name for name, on in norms_of(head.config).items() if on]
    if unserved:  # fc_norm / norm_output have no tensor in its converter; norm_before_fc is not checked there yet
        raise DraftsmithError(f"format=gguf: this head uses the EAGLE-3.1 norms {', '.join(unserved)}, which "
                              f"draftsmith has not checked in llama.cpp's EAGLE-3 graph; export format=eagle3 and "
                              f"serve it with vLLM.")
    num_layers = int((manifest_target or {}).get("num_layers") or 0)
    aux = (manifest_target or {}).get("aux_layer_ids") or (default_aux_layer_ids(num_layers) if num_layers else None)
    if aux is None:
        raise DraftsmithError("format=gguf: the head's manifest names no target layers, which llama.cpp must be told; "
                              "export a head folder written by draftsmith train.")
    return save_eagle3(head, folder, manifest_target, {"eagle_aux_hidden_state_layer_ids": [int(i) for i in aux]},
                       include_embeddings=options.include_embeddings, dtype=options.dtype, stage="export")


# ---- the method table's hooks (draftsmith.core.methods) --------------------------------------------------

load, save = folder_hooks(load_eagle3, save_eagle3)
# gguf: for `llama-server -md` (--spec-type draft-eagle3); the converter reads the target's config and tokenizer
FORMATS = {"eagle3": export_writer(save_eagle3), "speculators": speculators_writer(save_speculators),
           "gguf": gguf_writer(eagle3_for_gguf, "eagle3.gguf", needs_target=True)}


def card(options: dict, formats: list[str], commands: dict) -> dict:
    """EAGLE-3's parts of the card: what it is, tags, serving commands, files (`options`: the training run's method
    options, its defaults filled in by publish; `commands`: the engines' serving commands)."""
    commands = dict(commands)
    if formats[0] != "eagle3":
        del commands["sglang"]  # SGLang loads only the EAGLE-3 folder format
    return {
        "title": "An EAGLE-3 draft head",
        "method": ("EAGLE-3: one Llama decoder layer fed by the target's hidden states from three layers (low, "
                   "middle, high), fused by a linear layer, trained with the training-time test (the head's own "
                   f"outputs fed back for {options['ttt_steps']} steps, loss weights "
                   f"{options['ttt_decay']}^i) on the target's own answers. It drafts over a reduced "
                   "vocabulary mapped to the target's by `d2t` / `t2d`."),
        "tags": ["eagle3", "speculative-decoding", "draft-model", "draftsmith", "vllm"]
                + (["sglang"] if formats[0] == "eagle3" else []) + (["speculators"] if "speculators" in formats else []),
        "commands": commands,
        "no_sglang": "SGLang loads the EAGLE-3 format: publish with formats=[eagle3,...] to serve this head there.",
        "files": {"eagle3": "vLLM `LlamaForCausalLMEagle3`, SGLang", "speculators": "vLLM `Eagle3DraftModel`, speculators_config"},
        "draft_vocab_size": options.get("draft_vocab_size"),
    }


HOOKS = FolderHooks(architectures=ARCHITECTURES, formats=FORMATS, load=load, save=save, card=card,
                    foreign_architectures=FOREIGN_ARCHITECTURES,
                    # the target layers it reads (low, middle, high), captured by data-gen and computed by train /
                    # eval's runner
                    aux_layer_ids=default_aux_layer_ids)
