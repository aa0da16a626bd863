"""The folders of a DSpark drafter: draftsmith's own (what `draftsmith train method=dspark` writes, eval loads and vLLM
serves), the GGUF llama.cpp serves with `draft-dspark`, and speculators' format.

    format=dspark  config.json: DSparkDraftModel (a name llama.cpp's DSpark converter registers), the DFlash folder's
                   fields (heads/block_folders.py: the Qwen3 layer fields, draft_vocab_size, block_size,
                   eagle_aux_hidden_state_layer_ids, dflash_config {mask_token_id, target_layer_ids, causal: false}),
                   plus mask_token_id and target_layer_ids at the top (DeepSpec's Qwen3DSparkModel reads them
                   there; target_layer_ids in DFlash's convention, HF index - 1), markov_rank, markov_head_type
                   "vanilla", enable_confidence_head true, confidence_head_with_markov true, and sample_from_anchor
                   false, always written: llama.cpp's converter assumes true (DeepSeek's layout) when it is absent.
                   model.safetensors: the DFlash tensors, markov_head.markov_w1.weight (V, r),
                   markov_head.markov_w2.weight (Vd, r), confidence_head.proj.weight (1, H + r),
                   confidence_head.proj.bias (1,)
                   It is also the folder vLLM serves with method dspark (on a GPU: see below): vLLM's
                   SpeculativeConfig maps DSparkDraftModel with model_type qwen3 to DeepSpec's Qwen3DSparkModel
                   (qwen3_dspark.Qwen3DSparkForCausalLM), whose load_weights takes every tensor under these names
                   (t2d dropped as training-only, d2t as draft_id_to_target_id: offsets, as ours). So no second
                   folder is written under the name Qwen3DSparkModel: it would be this one renamed.
                   tests/test_dspark_vllm_folder.py checks it with vLLM for CPU's own code. Serve it with
                   num_speculative_tokens (at most block_size - 1): left unset, vLLM drafts block_size tokens,
                   one more than the bonus-anchor block holds.
    format=gguf    dspark.gguf for `llama-server -md ... --spec-type draft-dspark`: this very folder, converted by
                   llama.cpp's own DSpark converter (conversion/qwen.py DSparkModel, which registers
                   DSparkDraftModel) through heads/folders.py `gguf_writer`. It writes d2t as absolute target ids,
                   markov_w1 / markov_w2, conf_proj, `dflash.sample_from_anchor` false (from the config: its
                   default is true) and `dflash.has_confidence_head` true. Its runtime (src/models/dflash.cpp
                   build_dspark_markov_head) drafts as eval/proposers/dspark.py does: slot 1's bias from the bonus
                   token, each later slot's from the argmax of the slot before, over the target vocabulary; the
                   confidence is sigmoid(proj([norm(h_k); W1[prev_k]])), and `--spec-draft-p-min` stops a draft
                   before the first slot whose confidence is below it, drafting.stop_below's rule (the engine
                   check, tests/test_engine_llamacpp_block.py, runs at 0, where neither stops). A drafter over the
                   target's whole vocabulary is refused (block_folders.py `check_gguf_vocab`).
    format=speculators  speculators 0.9's DSparkSpeculator (`speculators_model_type: "dspark"`): speculators'
                   DFlash config (heads/dflash_folders.py: transformer_layer_config, block_size,
                   aux_hidden_state_layer_ids, mask_token_id, sample_from_anchor false, ...) plus markov_rank and
                   the head fields above; the tensors of format=dspark under the same names (speculators'
                   DSparkDraftModel holds markov_head.markov_w1 / markov_w2 and confidence_head.proj, fed
                   [norm(h_k); W1[prev_k]] as ours). Written, not read back (FOREIGN_ARCHITECTURES).

Written atomically (heads/folders.py `write_head_folder`); loading reads safetensors only, checks every tensor's
name, shape and dtype, and refuses in one sentence a folder that says another layout or head than the drafter
computes.

vLLM 0.32 serves DSpark only on its V2 model runner, which needs Triton; vLLM for CPU (no Triton CPU backend, so
its V1 runner) refuses to build an engine for it: "Model Runner V1 does not support: dspark speculative decoding".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from ..core import DraftsmithError
from ..core.layers import default_aux_layer_ids
from ..core.method_hooks import FolderHooks
from .block_folders import (GGUF_CONVERTER_ARCHITECTURE, check_gguf_vocab, check_target_layers,
                                            dflash_config_from_json, dflash_config_json, dflash_tensor_shapes,
                                            save_speculators_block, speculators_dflash_config_json)
from .dspark import DSparkHead
from .folders import (CONFIG, EMBED, WEIGHTS, build_head, export_verifier, folder_hooks,
                                      folder_tensors, gguf_writer, read_checked_tensors, read_config_json,
                                      speculators_config, with_target_embeddings, write_head_folder)

DSPARK_ARCHITECTURE = GGUF_CONVERTER_ARCHITECTURE  # "DSparkDraftModel": llama.cpp's DSpark converter reads the folder
ARCHITECTURES = (DSPARK_ARCHITECTURE,)
DSPARK_SPECULATORS_ARCHITECTURE = "DSparkSpeculator"
FOREIGN_ARCHITECTURES = {"Qwen3DSparkModel": "DeepSpec's DSpark format (Qwen3DSparkModel), which draftsmith does not read "
                                             "yet; give the DSpark folder draftsmith train wrote",
                         DSPARK_SPECULATORS_ARCHITECTURE: "the speculators format (vLLM loads it); give the DSpark "
                                                          "folder it was exported from"}
# what draftsmith's drafter computes, which its folder states and loading requires
HEAD_FIELDS = {"markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
               "sample_from_anchor": False}


def dspark_tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the folder (embed_tokens and d2t included) and its shape, for `config`."""
    r, H, V, Vd = config.markov_rank, config.hidden_size, config.vocab_size, config.draft_vocab_size
    return {**dflash_tensor_shapes(config), "markov_head.markov_w1.weight": (V, r),
            "markov_head.markov_w2.weight": (Vd, r), "confidence_head.proj.weight": (1, H + r),
            "confidence_head.proj.bias": (1,)}


def dspark_tensors(head: DSparkHead, dtype: Optional[torch.dtype] = None,
                   include_embeddings: bool = True) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the folder's names; d2t only with a reduced draft vocab (as DFlash's folder)."""
    tensors = folder_tensors(head, dspark_tensor_shapes(head.config), dtype, include_embeddings)
    if head.config.draft_vocab_size == head.config.vocab_size:
        del tensors["d2t"]
    return tensors


def dspark_config_json(head: DSparkHead, dtype: Optional[torch.dtype]) -> dict:
    config = dflash_config_json(head, dtype, DSPARK_ARCHITECTURE)
    return {**config, "mask_token_id": head.mask_token_id,
            "target_layer_ids": config["dflash_config"]["target_layer_ids"],
            "markov_rank": head.markov_rank, **HEAD_FIELDS}


def save_dspark(head: DSparkHead, folder: str | os.PathLike, manifest_target: dict | None = None, *,
                include_embeddings: bool = True, dtype: Optional[torch.dtype] = None, stage: str = "train") -> Path:
    """Write draftsmith's DSpark folder (atomically) and return its path."""
    tensors = dspark_tensors(head, dtype, include_embeddings)
    config = dspark_config_json(head, dtype or head.fc.weight.dtype)
    return write_head_folder(Path(folder), tensors, config, head.config.draft_vocab_size, manifest_target, stage,
                             "dspark")


def dspark_config_from_json(raw: dict, where: Path):
    """The drafter's config from the folder's config.json: the DFlash fields, the Markov rank, and the head fields
    (HEAD_FIELDS) as draftsmith's drafter computes them."""
    config = dflash_config_from_json(raw, where, DSPARK_ARCHITECTURE)
    rank = raw.get("markov_rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise DraftsmithError(f"{where} has markov_rank={rank!r}; expected a positive integer.")
    for key, value in HEAD_FIELDS.items():
        if raw.get(key) != value:
            raise DraftsmithError(f"{where} has {key}={raw.get(key)!r}; draftsmith's DSpark drafter computes "
                                  f"{key}={value!r} (the vanilla Markov head, the confidence head over [norm(h); "
                                  f"W1[previous token]], the bonus-anchor block).")
    config.markov_rank = rank
    return config


def load_dspark(folder: str | os.PathLike, device="cpu", dtype: Optional[torch.dtype] = None,
                target_embeddings: torch.Tensor | torch.nn.Embedding | None = None) -> DSparkHead:
    """Load a folder written by `save_dspark`, every tensor checked. A folder without embed_tokens needs the
    target's as `target_embeddings`; a full-vocab folder without d2t gets the identity map."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DraftsmithError(f"head folder {folder} does not exist.")
    config = dspark_config_from_json(read_config_json(folder), folder / CONFIG)
    expected = dspark_tensor_shapes(config)
    full_vocab = config.draft_vocab_size == config.vocab_size
    tensors = read_checked_tensors(folder / WEIGHTS, expected, optional=(EMBED,) + (("d2t",) if full_vocab else ()))
    if full_vocab:
        tensors.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
    head = build_head(DSparkHead, config, with_target_embeddings(tensors, expected, folder, target_embeddings),
                      device, dtype)
    head.embed_tokens.weight.requires_grad_(False)
    return head


# ---- the method table's hooks (draftsmith.core.methods) -------------------------------------------------------------

load_checked, save = folder_hooks(load_dspark, save_dspark)


def load(folder: Path, target=None) -> DSparkHead:
    """The method table's loader: beside a target, the folder's target layers must be the ones it computes."""
    head = load_checked(folder, target)
    assert isinstance(head, DSparkHead)  # load_checked is this module's loader
    return check_target_layers(head, folder, target)


def write_dspark(head: DSparkHead, folder: Path, manifest_target: Optional[dict], options) -> Path:
    return save_dspark(head, folder, manifest_target=manifest_target, dtype=options.dtype,
                       include_embeddings=options.include_embeddings, stage="export")


def dspark_for_gguf(head: DSparkHead, folder: Path, manifest_target: Optional[dict], options) -> Path:
    """The folder llama.cpp's DSpark converter reads: draftsmith's own (its architecture is one the converter
    registers, and it states sample_from_anchor false), in the float32 gguf_writer asks for."""
    check_gguf_vocab(head.config, "DSpark")
    return save_dspark(head, folder, manifest_target=manifest_target, dtype=options.dtype,
                       include_embeddings=options.include_embeddings, stage="export")


# ---- format=speculators: speculators' DSparkSpeculator ------------------------------------------------------

def speculators_dspark_config_json(head: DSparkHead, verifier: Optional[str], num_speculative_tokens: int,
                                   dtype: torch.dtype) -> dict:
    """speculators' DFlash config under DSpark's names, plus the Markov rank and the head fields draftsmith's drafter
    computes (its DSparkSpeculatorConfig defaults sample_from_anchor to true: written false)."""
    config = speculators_dflash_config_json(head, verifier, num_speculative_tokens, dtype)
    return {**config, "architectures": [DSPARK_SPECULATORS_ARCHITECTURE], "speculators_model_type": "dspark",
            "markov_rank": head.markov_rank, **HEAD_FIELDS,
            "speculators_config": speculators_config("dspark", verifier, num_speculative_tokens)}


def save_speculators_dspark(head: DSparkHead, folder: str | os.PathLike, verifier: Optional[str] = None,
                            num_speculative_tokens: Optional[int] = None, manifest_target: dict | None = None,
                            dtype: Optional[torch.dtype] = None, include_embeddings: bool = True) -> Path:
    """Write the drafter in speculators' DSpark format (atomically); K defaults to block_size - 1."""
    return save_speculators_block(head, folder, dspark_tensors, speculators_dspark_config_json, verifier, num_speculative_tokens, manifest_target,
                                  dtype, include_embeddings)


def write_speculators(head: DSparkHead, folder: Path, manifest_target: Optional[dict], options) -> Path:
    return save_speculators_dspark(head, folder, verifier=export_verifier(options, manifest_target),
                                   num_speculative_tokens=options.num_speculative_tokens,
                                   manifest_target=manifest_target, dtype=options.dtype,
                                   include_embeddings=options.include_embeddings)


# gguf: for `llama-server -md dspark.gguf --spec-type draft-dspark`
FORMATS = {"dspark": write_dspark, "speculators": write_speculators,
           "gguf": gguf_writer(dspark_for_gguf, "dspark.gguf", needs_target=True)}


# no card: publish does not describe DSpark heads yet
HOOKS = FolderHooks(architectures=ARCHITECTURES, formats=FORMATS, load=load, save=save,
                    foreign_architectures=FOREIGN_ARCHITECTURES,
                    # the target layers it reads (DFlash's: low, middle, high), captured by data-gen and computed by
                    # train / eval's runner
                    aux_layer_ids=default_aux_layer_ids)
