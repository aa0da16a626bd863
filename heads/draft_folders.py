"""The draft model's folder: a plain HF causal-LM folder (LoRA merged), what vLLM's draft_model method, SGLang's
STANDALONE algorithm and transformers' assistant_model load.

    save_draft(drafter, folder) model.safetensors + config.json + generation_config.json + tokenizer
                                (+ manifest.json)
    load_draft_folder(folder)   from checked safetensors only (never pickle), running none of the folder's code
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..core.artifacts import atomic_folder, write_manifest
from ..core.method_hooks import FolderHooks
from ..core.trust import remote_code_refused
from .draft import DRAFT_CODE_FIX, DraftLM, check_draft_weights
from .folders import gguf_writer


def load_draft_folder(folder: str | Path, *, dtype: Optional[torch.dtype] = None, links_ok: bool = False):
    """An HF causal-LM folder as transformers loads it, but from checked safetensors only (never pickle) and
    running none of the folder's code: what eval, export and publish load a draft-model head with. Its tokenizer
    (what export copies) is read first, before the weights, and kept as `draftsmith_tokenizer`."""
    folder = Path(folder)
    check_draft_weights(folder, links_ok=links_ok)
    with remote_code_refused(folder, "draft model", DRAFT_CODE_FIX):
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False) \
            if (folder / "tokenizer_config.json").is_file() else None
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True, trust_remote_code=False)
    # torch types nn.Module.__setattr__'s value as a Tensor or Module, while it keeps any other value as a plain
    # attribute (which this is)
    model.draftsmith_tokenizer = tokenizer  # type: ignore[assignment]
    return model


# ---- the folder ------------------------------------------------------------------------------------

def save_draft(drafter, folder, manifest_target: Optional[dict] = None, stage: str = "train",
               dtype: Optional[torch.dtype] = None) -> Path:
    """Write a plain HF model folder (LoRA merged) atomically: model.safetensors, config.json,
    generation_config.json, the tokenizer and, with a target identity, manifest.json."""
    folder = Path(folder)
    model = drafter.merged() if isinstance(drafter, DraftLM) else drafter
    if dtype is not None:
        # transformers wraps PreTrainedModel.to in functools.wraps(nn.Module.to), whose typeshed type does not bind
        # self (mypy reads `dtype` as the model)
        model = model.to(dtype)  # type: ignore[arg-type]
    tokenizer = drafter.config.tokenizer if isinstance(drafter, DraftLM) else _folder_tokenizer(drafter)
    with atomic_folder(folder, owner="export" if stage == "export" else None) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if manifest_target is not None:
            counts = {"parameters": sum(p.numel() for p in model.parameters()),
                      "num_layers": model.config.num_hidden_layers}
            source = drafter.config.source if isinstance(drafter, DraftLM) else None
            write_manifest(tmp, stage, manifest_target, counts, format="hf", init=source)
    return folder


def _folder_tokenizer(model):
    """The tokenizer saved beside a loaded HF model (what export copies), or None."""
    if getattr(model, "draftsmith_tokenizer", None) is not None:
        return model.draftsmith_tokenizer  # read by load_draft_folder
    folder = Path(getattr(model, "name_or_path", "") or "")
    if not (folder / "tokenizer_config.json").is_file():
        return None
    with remote_code_refused(folder, "draft model", DRAFT_CODE_FIX):
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


# ---- the method table's hooks (draftsmith.core.methods) -------------------------------------------------------------------

ARCHITECTURES: tuple[str, ...] = ()  # the catch-all: any HF causal-LM folder is evaluated as a draft model


def load(folder: Path, target=None):
    if target is None:
        return load_draft_folder(folder).eval()
    return load_draft_folder(folder, dtype=target.dtype).to(target.device).eval()


def save(drafter, folder: Path, identity: dict) -> Path:
    return save_draft(drafter, folder, manifest_target=identity)


def export_hf(model, folder: Path, manifest_target: Optional[dict], options) -> Path:
    return save_draft(model, folder, manifest_target, stage="export", dtype=options.dtype)


# gguf: the folder as llama.cpp's converter reads it, for `llama-server -md` (--spec-type draft-simple)
FORMATS = {"hf": export_hf, "gguf": gguf_writer(export_hf, "draft.gguf")}


def card(options: dict, formats: list[str], commands: dict) -> dict:
    """A draft model's parts of the card: what it is, tags, serving commands, files (`options`: the training run's
    method options, its defaults filled in by publish; `commands`: the engines' serving commands)."""
    init = options["init"]
    start = {"from_target": f"{options['num_layers']} of the target's layers with its embeddings, final "
                            "norm and lm_head",
             "from_model": f"the causal LM {options.get('model')!r}",
             "scratch": "a randomly initialised decoder of the target's family"}.get(init, init)
    lora_on = options["lora"]["enabled"]
    lora = options["lora"]["r"] if (lora_on if lora_on is not None else init == "from_model") else None
    return {
        "title": "A draft model",
        "method": (f"A small causal LM that shares the target's tokenizer, started from {start} and distilled on the "
                   f"target's own answers (loss {options['loss']} between the draft's and the target's "
                   f"next-token distributions, temperature {options['temperature']}"
                   + (f", LoRA rank {lora} merged into the weights" if lora else "") + "). It drafts K tokens "
                   "autoregressively with its own KV cache; the target verifies them."),
        "tags": ["draft-model", "speculative-decoding", "draftsmith", "vllm", "sglang"],
        "commands": dict(commands),
        "no_sglang": "",
        "files": {"hf": "a plain Hugging Face causal-LM folder (safetensors, config, tokenizer): vLLM's draft_model "
                        "method, SGLang's STANDALONE algorithm"},
        "draft_vocab_size": None,
    }


HOOKS = FolderHooks(architectures=ARCHITECTURES, formats=FORMATS, load=load, save=save, card=card)
