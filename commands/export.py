"""`draftsmith export`: write a trained drafter in an engine's format.

The head folder's method (draftsmith.core.methods, by its config.json `architectures`) loads it and
names its formats, e.g. for EAGLE-3 heads `format=eagle3` (the folder vLLM and SGLang load,
heads/eagle3_folders.py) and `format=speculators` (vLLM's speculators format, the same file).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from omegaconf.errors import MissingMandatoryValue

from draftsmith.core import DraftsmithError, checks, llamacpp
from draftsmith.core.artifacts import MANIFEST, claim_output, owns, prepare_output, read_manifest
from draftsmith.data_gen.target import DTYPES, KNOWN_TARGETS, PRESETS, TargetConfig, load_target, torch_dtype
from draftsmith.core.engine import NUM_SPECULATIVE_TOKENS, served_folder
from draftsmith.heads.folders import CONFIG, FormatOptions
from draftsmith.core.methods import export_formats, method_for_folder

log = logging.getLogger(__name__)


@dataclass
class ExportConfig:
    head: str = "???"  # folder written by `draftsmith train` (its final/)
    format: Optional[str] = None  # one of the head's method's formats; None = its first (EAGLE-3: eagle3 | speculators)
    out: Optional[str] = None  # output folder; default: beside the head, `<head>-<format>`
    # speculators: the verifier's HF id or folder (default: the target id in the head's manifest)
    verifier: Optional[str] = None
    # gguf (EAGLE-3): the target's HF folder whose config and tokenizer llama.cpp's converter reads (default: the
    # head's target, e.g. the embedded GGUF's cached safetensors copy)
    target_dir: Optional[str] = None
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS  # K; speculators: the greedy proposal's length
    # dtype of a folder format's weights: bfloat16 | float16 | float32; null = bfloat16 (format=gguf: gguf_outtype)
    dtype: Optional[str] = None
    # format=gguf: the file's weight type, llama.cpp's --outtype: f32 | f16 | bf16 | q8_0 (docs/llamacpp.md)
    gguf_outtype: str = llamacpp.OUTTYPE
    include_embeddings: bool = True  # False: engines share the target's embeddings
    overwrite: bool = False  # true: replace an out folder that is not an earlier export (never the head's)

    def __post_init__(self):
        if not self.head:
            raise DraftsmithError("export.head is not set: pass head=<folder written by draftsmith train>.")
        if self.format is not None:
            checks.one_of("format", self.format, export_formats())
        checks.at_least("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.dtype is not None:
            checks.one_of("dtype", self.dtype, DTYPES)
        checks.one_of("gguf_outtype", self.gguf_outtype, llamacpp.OUTTYPES)


# ---------------------------------------------------------------------------------------------
# The stage


def is_set(cfg, key: str) -> bool:
    """False for a missing (`???`) or empty option, for OmegaConf and plain dataclass configs alike."""
    try:
        value = getattr(cfg, key)
    except MissingMandatoryValue:
        return False
    return bool(value) and value != "???"


def run(cfg: ExportConfig) -> Path:
    """Load the head folder `cfg.head` with its method, write it to `cfg.out` in `cfg.format`, return the path."""
    if not is_set(cfg, "head"):
        raise DraftsmithError("export.head is not set: pass head=<folder written by draftsmith train>.")
    head_dir = Path(cfg.head)
    if not head_dir.is_dir():
        raise DraftsmithError(f"head folder {head_dir} does not exist.")
    if not (head_dir / CONFIG).is_file():
        raise DraftsmithError(f"head={str(head_dir)!r} has no {CONFIG}: give the folder written by draftsmith train "
                              f"(its final/).")
    method = method_for_folder(head_dir)
    fmt = cfg.format or next(iter(method.formats), None)
    if fmt in method.unserved_formats:
        raise DraftsmithError(f"format={fmt} cannot be written for {method.name} heads: {method.unserved_formats[fmt]}.")
    if fmt not in method.formats:
        raise DraftsmithError(f"format={fmt} is not a format of {method.name} heads; choose from "
                              f"{', '.join(method.formats) or 'none (it cannot be exported)'}.")
    if fmt == "gguf" and cfg.dtype is not None:
        refuse_gguf_dtype(cfg.dtype)
    out = Path(cfg.out) if cfg.out else head_dir.with_name(f"{head_dir.name}-{fmt}")
    inputs = [("head", head_dir)] + ([("verifier", cfg.verifier)] if cfg.verifier else [])
    out = prepare_output(out, "export", inputs, overwrite=bool(cfg.overwrite))
    drafter = method.load(head_dir)
    target = read_manifest(head_dir).get("target") if (head_dir / MANIFEST).is_file() else None
    created = not out.exists()
    if not owns(out, "export"):
        claim_output(out, "export")  # the atomic swap below then replaces only our own folder
    verifier = cfg.verifier or (default_verifier((target or {}).get("target_id")) if fmt == "speculators" else None)
    target_id = (target or {}).get("target_id")
    options = FormatOptions(torch_dtype(cfg.dtype or FOLDER_DTYPE), cfg.include_embeddings, verifier,
                            cfg.num_speculative_tokens, lambda: head_target_folder(cfg.target_dir, target_id),
                            cfg.gguf_outtype)
    try:
        return method.formats[fmt](drafter, out, target, options)
    except BaseException:
        if created:  # made just now, holding only our claim: a failed export leaves nothing behind
            shutil.rmtree(out, ignore_errors=True)
        raise


FOLDER_DTYPE = "bfloat16"  # a folder format's weights when dtype is not given
GGUF_OF_DTYPE = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}  # the dtype route it replaced


def refuse_gguf_dtype(dtype: str) -> None:
    """format=gguf's type is gguf_outtype alone (one name, one default): a dtype= given with it, as configs written
    before gguf_outtype did, is refused with the gguf_outtype that writes what that dtype wrote."""
    same = GGUF_OF_DTYPE.get(torch_dtype(dtype))
    instead = f"gguf_outtype={same}" if same else f"gguf_outtype=<{' | '.join(llamacpp.OUTTYPES)}>"
    raise DraftsmithError(f"format=gguf writes the weight type gguf_outtype names ({', '.join(llamacpp.OUTTYPES)}), "
                          f"not dtype: pass {instead} in place of dtype={dtype}.")


def default_verifier(target_id: Optional[str]) -> Optional[str]:
    """The speculators folder's verifier when export.verifier is not given: the head's target, as vLLM can load it.

    vLLM serves a speculators folder as the model and loads its verifier by name, so a draftsmith preset name
    (`smollm2`) would fail there ("Invalid repository ID or local directory"): a preset with a Hub id gets that
    id, with a warning, since the Hub weights are not the dequantised GGUF the head was trained on."""
    if target_id not in PRESETS:
        return target_id
    hub_id = KNOWN_TARGETS.get(target_id, (None,))[0]
    if hub_id is None:
        log.warning(f"export: warning: the head's target is the preset {target_id!r}, which vLLM cannot load as the "
                    f"speculators verifier; pass verifier=<HF folder or hub id> to serve this folder.")
        return target_id
    log.warning(f"export: verifier={hub_id} (the Hub id of the preset {target_id!r}); its weights are not the "
                f"dequantised GGUF the head was trained on: pass verifier=<HF folder> to serve those.")
    return hub_id


def head_target_folder(target_dir: Optional[str], target_id: Optional[str]) -> Path:
    """The target's HF folder (config.json + tokenizer) a format writer reads: export.target_dir, else the head's
    target as draftsmith loads it (a preset or GGUF file: its cached safetensors copy), its weights not read."""
    if target_dir:
        folder = Path(target_dir)
        if not (folder / CONFIG).is_file():
            raise DraftsmithError(f"export.target_dir={target_dir!r} has no config.json: give the target's HF folder.")
        return folder
    if not target_id:
        raise DraftsmithError("this format needs the target's config and tokenizer, and the head has no manifest "
                              "naming its target: pass target_dir=<the target's HF folder>.")
    target = load_target(TargetConfig(name=target_id), lazy=True)
    try:
        folder = Path(served_folder(target, "export format=gguf"))
    except DraftsmithError:  # a preset with no folder of its own (tiny)
        folder = Path()
    if not (folder / CONFIG).is_file():
        raise DraftsmithError(f"export format=gguf: the head's target {target_id!r} is not a local folder; pass "
                              f"target_dir=<the target's HF folder>.")
    return folder


def summary(path: Path) -> str:
    return f"draftsmith export: wrote the head to {path}"
