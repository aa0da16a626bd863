"""The folders of a DFlash drafter: the one vLLM serves with `method: dflash`, vLLM's speculators format, and the
GGUF llama.cpp serves with `draft-dflash`.

    format=dflash       config.json: DFlashDraftModel, model_type qwen3 (vLLM reads it with AutoConfig), the
                        drafter's layer count and sizes, draft_vocab_size, every layer "full_attention" and
                        dflash_config {mask_token_id, target_layer_ids (DFlash's convention: HF index - 1),
                        causal: false}, eagle_aux_hidden_state_layer_ids (HF hidden_states indices, what vLLM
                        reads first), block_size. model.safetensors: fc, hidden_norm, layers.{i}.* (q_norm /
                        k_norm included), norm, lm_head, t2d (bool), d2t (int64; only with a reduced draft
                        vocab: vLLM has no d2t parameter otherwise) [, embed_tokens]
    format=speculators  config.json: DFlashSpeculator, speculators_model_type "dflash", transformer_layer_config
                        (a Qwen3 config with the layer count), block_size, aux_hidden_state_layer_ids,
                        mask_token_id, sliding_window_non_causal true (vLLM turns false into causal attention
                        for EVERY layer), sample_from_anchor false, speculators_config; the same tensors
    format=gguf         dflash.gguf for `llama-server -md ... --spec-type draft-dflash`, written by llama.cpp's own
                        converter (heads/folders.py `gguf_writer`) from the folder `dflash_for_gguf` prepares

The target layers are always written explicitly: without them vLLM sizes fc as num_hidden_layers * H_t.
The folders are written atomically (heads/folders.py `write_head_folder`); loading reads safetensors only and
checks every tensor's name, shape and dtype.

The GGUF route. llama.cpp's plain DFlash converter (conversion/qwen.py DFlashModel) maps no d2t, and draftsmith's
DFlash drafters draft over a reduced vocabulary. Its DSpark converter (DSparkModel, a DFlashModel) does: it writes
d2t as absolute target ids. So the drafter goes to llama.cpp as a DSpark folder with no Markov head at all (no
markov_head.* and no confidence_head.* tensors, `sample_from_anchor: false`), and the GGUF is exactly DFlash's:
  - the converter writes the same arch (`dflash`), the same backbone tensors and keys, plus `d2t`,
    `dflash.sample_from_anchor` false and `dflash.has_confidence_head` false;
  - the runtime builds the Markov bias only when `markov_w1.weight` is in the file (src/models/dflash.cpp
    load_arch_tensors and the graph's `if (model.dspark_markov_w1)`), scatters the draft logits to the target
    vocabulary through `d2t` for DFlash and DSpark alike, and reads `sample_from_anchor` only for draft-dspark;
  - `--spec-type draft-dflash` (common/speculative.cpp common_speculative_impl_draft_dflash, is_dspark false)
    decodes [last token, mask x K] in one call and reads the mask rows 1..K greedily: draftsmith's DFlash layout
    (the mask query at p+k drafts the token at p+k).
tests/test_engine_llamacpp_block.py checks it in llama-server: lossless, and τ equal to the built-in decoder's.
A drafter over the target's whole vocabulary is refused (block_folders.py `check_gguf_vocab`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from .block_folders import (DFLASH_ARCHITECTURE, DFLASH_SPECULATORS_ARCHITECTURE,
                                            GGUF_CONVERTER_ARCHITECTURE, check_gguf_vocab, check_target_layers,
                                            dflash_config_json, dflash_tensor_shapes, read_dflash_folder,
                                            save_speculators_block, speculators_dflash_config_json)
from .dflash import DFlashHead
from .folders import (build_head, export_verifier, folder_hooks,
                                      folder_tensors, gguf_writer, with_target_embeddings,
                                      write_head_folder)
from ..core.layers import default_aux_layer_ids
from ..core.method_hooks import FolderHooks

ARCHITECTURES = (DFLASH_ARCHITECTURE,)
FOREIGN_ARCHITECTURES = {DFLASH_SPECULATORS_ARCHITECTURE: "the speculators format (vLLM loads it); give the DFlash "
                                                          "folder it was exported from"}


def dflash_tensors(head: DFlashHead, dtype: Optional[torch.dtype] = None,
                   include_embeddings: bool = True) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the folder's names, contiguous on CPU, floats in `dtype`; d2t only with a
    reduced draft vocab (a full-vocab drafter's d2t is all zeros, and vLLM refuses the tensor there)."""
    tensors = folder_tensors(head, dflash_tensor_shapes(head.config), dtype, include_embeddings)
    if head.config.draft_vocab_size == head.config.vocab_size:
        del tensors["d2t"]
    return tensors


# ---- format=dflash: the folder vLLM serves with method dflash ----------------------------------------------

def save_dflash(head: DFlashHead, folder: str | os.PathLike, manifest_target: dict | None = None, *,
                include_embeddings: bool = True, dtype: Optional[torch.dtype] = None, stage: str = "train") -> Path:
    """Write the folder vLLM serves with method dflash (atomically) and return its path."""
    tensors = dflash_tensors(head, dtype, include_embeddings)
    config = dflash_config_json(head, dtype or head.fc.weight.dtype, DFLASH_ARCHITECTURE)
    return write_head_folder(Path(folder), tensors, config, head.config.draft_vocab_size, manifest_target, stage,
                             "dflash")


def load_dflash(folder: str | os.PathLike, device="cpu", dtype: Optional[torch.dtype] = None,
                target_embeddings: torch.Tensor | torch.nn.Embedding | None = None) -> DFlashHead:
    """Load a folder written by `save_dflash`, every tensor checked. A folder without embed_tokens needs the
    target's as `target_embeddings`; a full-vocab folder without d2t gets the identity map."""
    folder = Path(folder)
    config, tensors = read_dflash_folder(folder)
    head = build_head(DFlashHead, config, with_target_embeddings(tensors, dflash_tensor_shapes(config), folder,
                                                                 target_embeddings), device, dtype)
    head.embed_tokens.weight.requires_grad_(False)
    return head


# ---- format=speculators: vLLM's speculators format, type dflash ----------------------------------------------

def save_speculators_dflash(head: DFlashHead, folder: str | os.PathLike, verifier: Optional[str] = None,
                            num_speculative_tokens: Optional[int] = None, manifest_target: dict | None = None,
                            dtype: Optional[torch.dtype] = None, include_embeddings: bool = True) -> Path:
    """Write the drafter in speculators' DFlash format (atomically); K defaults to block_size - 1."""
    return save_speculators_block(head, folder, dflash_tensors, speculators_dflash_config_json, verifier, num_speculative_tokens, manifest_target,
                                  dtype, include_embeddings)


# ---- format=gguf: llama.cpp, through its own converter ----------------------------------------------------------

def dflash_for_gguf(head: DFlashHead, folder: Path, manifest_target: Optional[dict], options) -> Path:
    """The folder llama.cpp's converter turns into DFlash's GGUF: the DFlash tensors and config under the DSpark
    converter's architecture, with no Markov or confidence head and draftsmith's bonus-anchor layout stated
    (the module docstring says why this is exactly DFlash in llama.cpp). The converter reads the target's
    tokenizer (gguf_writer's needs_target)."""
    check_gguf_vocab(head.config, "DFlash")
    tensors = dflash_tensors(head, options.dtype, options.include_embeddings)
    # written, though draft-dflash never reads it: the converter's default (true) would be another drafter's layout
    config = {**dflash_config_json(head, options.dtype, GGUF_CONVERTER_ARCHITECTURE), "sample_from_anchor": False}
    return write_head_folder(Path(folder), tensors, config, head.config.draft_vocab_size, manifest_target, "export",
                             "gguf-source")


# ---- the method table's hooks (draftsmith.core.methods) -------------------------------------------------------------

load_checked, save = folder_hooks(load_dflash, save_dflash)


def load(folder: Path, target=None) -> DFlashHead:
    """The method table's loader: beside a target, the folder's target layers must be the ones it computes."""
    head = load_checked(folder, target)
    assert isinstance(head, DFlashHead)  # load_checked is this module's loader
    return check_target_layers(head, folder, target)


def write_dflash(head: DFlashHead, folder: Path, manifest_target: Optional[dict], options) -> Path:
    return save_dflash(head, folder, manifest_target=manifest_target, dtype=options.dtype,
                       include_embeddings=options.include_embeddings, stage="export")


def write_speculators(head: DFlashHead, folder: Path, manifest_target: Optional[dict], options) -> Path:
    return save_speculators_dflash(head, folder, verifier=export_verifier(options, manifest_target),
                                   num_speculative_tokens=options.num_speculative_tokens, manifest_target=manifest_target,
                                   dtype=options.dtype, include_embeddings=options.include_embeddings)


def engine_warning(drafter, result: dict) -> Optional[str]:
    """The method table's optional hook: one sentence where this vLLM computes the drafter otherwise than its
    contract (its rms_norm kernel ignores the stacked k_norm weights of the context keys: the worker's probe
    `grouped_rms_norm_ok` in the job's `result`), which changes a drafter of two layers or more; None elsewhere.
    `drafter`: eval's drafter (its `info` holds the folder's num_layers)."""
    layers = int((drafter.info or {}).get("num_layers") or 0)
    if layers < 2 or result.get("grouped_rms_norm_ok") is not False:
        return None
    return (f"this vLLM ({result.get('vllm_version')}) normalizes the context keys of every layer of the "
            f"{layers}-layer DFlash drafter with layer 0's k_norm (its rms_norm kernel ignores the stacked per-layer "
            "weight that qwen3_dflash.py's _normalize_context_k passes; vLLM's CUDA kernel takes it), so its tau is "
            "that of a slightly different drafter and can differ from the built-in decoder's and from vLLM's on a GPU")


# gguf: for `llama-server -md dflash.gguf --spec-type draft-dflash`
FORMATS = {"dflash": write_dflash, "speculators": write_speculators,
           "gguf": gguf_writer(dflash_for_gguf, "dflash.gguf", needs_target=True)}


def card(options: dict, formats: list[str], commands: dict) -> dict:
    """DFlash's parts of the card (`options`: the training run's method options, its defaults filled in by publish;
    `commands`: the engines' serving commands)."""
    block = options["block_size"]
    return {
        "title": "A DFlash (block-parallel) drafter",
        "method": (f"DFlash: a {options['num_layers']}-layer drafter that proposes a block of "
                   f"{block - 1} tokens in one forward: the target's hidden states from three layers, fused by a "
                   "linear layer, are the keys and values of every layer's attention, and the block (the last "
                   "verified token followed by mask tokens) attends to them and to itself without a causal mask. "
                   f"Trained on the target's own answers with cross-entropy over the block positions "
                   f"({options['loss_weighting']} position weights); it drafts over a reduced "
                   "vocabulary mapped to the target's by `d2t` / `t2d`."),
        "tags": ["dflash", "speculative-decoding", "draft-model", "draftsmith", "vllm"]
                + (["speculators"] if "speculators" in formats else []),
        "commands": {k: v for k, v in commands.items() if k != "sglang"},
        "no_sglang": "SGLang's DFLASH flags were not confirmed from its documentation here: serve this head with vLLM.",
        "files": {"dflash": "vLLM `DFlashDraftModel` (method dflash)",
                  "speculators": "vLLM `DFlashSpeculator`, speculators_config (algorithm dflash)"},
        "draft_vocab_size": options.get("draft_vocab_size"),
    }


HOOKS = FolderHooks(architectures=ARCHITECTURES, formats=FORMATS, load=load, save=save, card=card,
                    foreign_architectures=FOREIGN_ARCHITECTURES,
                    # the target layers it reads (low, middle, high: EAGLE-3's, so data-gen's shards serve it),
                    # captured by data-gen and computed by train / eval's runner; its folders always name them
                    aux_layer_ids=default_aux_layer_ids, engine_warning=engine_warning)
