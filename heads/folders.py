"""What every head folder shares: file names, tensor lists and checks, the Llama layer block of config.json,
the `LlamaForCausalLMEagle3` config both EAGLE-style methods write, the speculators config block, and atomic
writes.

    folder/
      config.json         the engine's config (a method's folders module writes it)
      model.safetensors   the head's tensors (d2t int64 and t2d bool whatever the weights' dtype)
      manifest.json       draftsmith's manifest (stage, target identity), when a target is given

Folders are written atomically: everything goes into a hidden sibling folder that is renamed into place only
when complete, so a crash never leaves a folder that looks finished and never destroys the one that was there.
Loading uses safetensors only (no pickle) and checks every tensor name, shape and dtype before building the head.
A method's own folders live in heads/<method>_folders.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..core import DraftsmithError, llamacpp
from ..core.artifacts import atomic_folder, atomic_write_json, claim_output, write_manifest
from ..core.engine import NUM_SPECULATIVE_TOKENS
from ..core.layers import default_aux_layer_ids
from ..core.trust import check_weights_file
from .kit import DEFAULT_ROPE_THETA, draft_config_from_target

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # vLLM's and SGLang's architecture of EAGLE-style heads
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
EMBED = "embed_tokens.weight"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config schema this writes


# ---------------------------------------------------------------------------------------------
# What a folder holds


def layer_shapes(config, prefix: str, in_width: int) -> dict[str, tuple[int, ...]]:
    """One Llama decoder layer's tensors under `prefix` whose q/k/v read `in_width` features."""
    H, I = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {
        prefix + "input_layernorm.weight": (H,),
        prefix + "post_attention_layernorm.weight": (H,),
        prefix + "self_attn.q_proj.weight": (q, in_width),
        prefix + "self_attn.k_proj.weight": (kv, in_width),
        prefix + "self_attn.v_proj.weight": (kv, in_width),
        prefix + "self_attn.o_proj.weight": (H, q),
        prefix + "mlp.gate_proj.weight": (I, H),
        prefix + "mlp.up_proj.weight": (I, H),
        prefix + "mlp.down_proj.weight": (H, I),
    }


# The vocab map keeps its integer / boolean dtypes whatever the weights' dtype.
FIXED_DTYPES = {"d2t": torch.int64, "t2d": torch.bool}


def folder_tensors(head: torch.nn.Module, names, dtype: Optional[torch.dtype] = None,
                   include_embeddings: bool = True) -> dict[str, torch.Tensor]:
    """`names` of the head's state dict, contiguous on CPU, floats in `dtype` (d2t / t2d keep theirs)."""
    state = head.state_dict()
    out = {}
    for name in names:
        if name == EMBED and not include_embeddings:
            continue
        t = state[name].detach()
        t = t.to(FIXED_DTYPES[name]) if name in FIXED_DTYPES else t.to(dtype or t.dtype)
        out[name] = t.to("cpu").contiguous()
    return out


def rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", DEFAULT_ROPE_THETA)))


def llama_layer_config(config, dtype: Optional[torch.dtype] = None) -> dict:
    """The 1-layer Llama fields both formats share (sizes, heads, rope, eps), as JSON."""
    rope = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default"})
    rope.setdefault("rope_theta", rope_theta(config))
    fields = {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": rope_theta(config),  # engines read the top-level key
        "rope_parameters": rope,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    if rope.get("rope_type", "default") != "default":
        fields["rope_scaling"] = rope  # the older name engines still read
    if dtype is not None:
        fields["torch_dtype"] = str(dtype).removeprefix("torch.")
    return fields


def eagle3_architecture_config(config, manifest_target: Optional[dict] = None,
                       dtype: Optional[torch.dtype] = None) -> dict:
    """config.json of vLLM's and SGLang's `LlamaForCausalLMEagle3` architecture (the EAGLE-3 folder; P-EAGLE's parallel
    drafting folder adds its fields to it)."""
    out = {
        "architectures": [EAGLE3_ARCHITECTURE],
        **llama_layer_config(config, dtype),
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": False,  # the residual is the un-normed hidden
    }
    target_hidden = getattr(config, "target_hidden_size", None)
    if target_hidden and target_hidden != config.hidden_size:
        out["target_hidden_size"] = target_hidden
    aux = explicit_aux_layer_ids(manifest_target)
    if aux is not None:
        # vLLM reads the residual entering layer i (HF hidden_states[i]); SGLang captures the
        # output of layer i, one less. Written only when not the default both assume.
        out["eagle_aux_hidden_state_layer_ids"] = aux
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]}
    return out


def explicit_aux_layer_ids(manifest_target: Optional[dict]) -> Optional[list[int]]:
    """The target's aux-layer ids (HF hidden_states indices) when they are not the default."""
    if not manifest_target or manifest_target.get("aux_layer_ids") is None:
        return None
    aux = [int(i) for i in manifest_target["aux_layer_ids"]]
    num_layers = manifest_target.get("num_layers")
    if num_layers is not None and aux == default_aux_layer_ids(int(num_layers)):
        return None
    return aux


def speculators_fields(config, architecture: str, model_type: str, layer: dict, verifier: Optional[str],
                       num_speculative_tokens: int, manifest_target: Optional[dict], dtype: torch.dtype,
                       embed_requires_grad: bool, extra: Optional[dict] = None,
                       norms: Optional[dict[str, bool]] = None) -> dict:
    """config.json of the speculators format for our layer (raw-h residual; no extra norms unless `norms` turns
    some of norm_before_fc / fc_norm / norm_output on): what every method's speculators folder shares; `extra`
    (e.g. P-EAGLE's mask_token_id) follows the aux-layer ids."""
    aux = (manifest_target or {}).get("aux_layer_ids")
    num_layers = (manifest_target or {}).get("num_layers")
    if aux is None and num_layers is not None:
        aux = default_aux_layer_ids(int(num_layers))
    target_hidden = getattr(config, "target_hidden_size", None)
    return {
        "architectures": [architecture],
        "speculators_model_type": model_type,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": target_hidden if target_hidden and target_hidden != config.hidden_size else None,
        # speculators uses HF hidden_states indices, as we do (2, N//2, N-3 by default)
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in aux] if aux is not None else None,
        **(extra or {}),
        # What our layer does: residual = un-normed h; by default no norm on the fused features, pre-norm h fed back.
        "norm_before_residual": False,
        **{"norm_before_fc": False, "fc_norm": False, "norm_output": False, **(norms or {})},
        "embed_requires_grad": bool(embed_requires_grad),
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "speculators_config": speculators_config(model_type, verifier, num_speculative_tokens),
    }


def speculators_config(algorithm: str, verifier: Optional[str], num_speculative_tokens: int) -> dict:
    """The `speculators_config` block: the greedy proposal of `num_speculative_tokens` (speculators' key:
    `speculative_tokens`) and the verifier."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [{
            "proposal_type": "greedy",
            "speculative_tokens": int(num_speculative_tokens),
            "verifier_accept_k": 1,
            "accept_tolerance": 0.0,
        }],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": verifier_architectures(verifier)},
    }


def verifier_architectures(verifier: Optional[str]) -> list[str]:
    """The verifier's `architectures`, read from its config.json when it is a local folder."""
    path = Path(verifier) / CONFIG if verifier else None
    if path is not None and path.is_file():
        return list(json.loads(path.read_text()).get("architectures") or [])
    return []


# ---------------------------------------------------------------------------------------------
# Atomic folders


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: Optional[dict] = None) -> None:
    save_file(tensors, str(path), metadata={"format": "pt", **(metadata or {})})


def write_head_folder(folder: Path, tensors: dict, config: dict, draft_vocab_size: int,
                      manifest_target: dict | None, stage: str, fmt: str) -> Path:
    """Write weights, config.json and (with a target identity) manifest.json into `folder` atomically.

    The export stage replaces only its own earlier output (a folder that is not is refused), and
    marks a folder without a manifest as its own so that a rerun may replace it.
    """
    owner = stage if stage == "export" else None
    with atomic_folder(folder, owner=owner) as tmp:
        write_safetensors(tmp / WEIGHTS, tensors)
        atomic_write_json(tmp / CONFIG, config)
        if manifest_target is not None:
            counts = {"draft_vocab_size": draft_vocab_size,
                      "parameters": sum(t.numel() for n, t in tensors.items() if n not in FIXED_DTYPES)}
            write_manifest(tmp, stage, manifest_target, counts, format=fmt)
        elif owner is not None:
            claim_output(tmp, owner)
    return folder


# ---------------------------------------------------------------------------------------------
# Load


def read_config_json(folder: Path) -> dict:
    path = folder / CONFIG
    if not path.is_file():
        raise DraftsmithError(f"{folder} is not an EAGLE-3 head folder: it has no {CONFIG}.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{path} is not valid JSON (line {e.lineno}): {e.msg}.") from None


def config_from_json(config: dict, where: Path):
    """Rebuild a head's LlamaConfig from a config.json of vLLM's EAGLE-3 architecture (EAGLE-3 and P-EAGLE folders)."""
    if EAGLE3_ARCHITECTURE not in (config.get("architectures") or []):
        raise DraftsmithError(f"{where} declares architectures {config.get('architectures')!r}, "
                              f"not [{EAGLE3_ARCHITECTURE!r}].")
    required = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "draft_vocab_size", "rms_norm_eps", "max_position_embeddings")
    for key in required:
        if key not in config:
            raise DraftsmithError(f"{where} has no {key!r}.")
    fields = {k: config[k] for k in required}
    fields["head_dim"] = config.get("head_dim")
    fields["hidden_act"] = config.get("hidden_act", "silu")
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", DEFAULT_ROPE_THETA)}
    fields["rope_parameters"] = rope
    llama = draft_config_from_target(types.SimpleNamespace(**fields), config["draft_vocab_size"])
    llama.target_hidden_size = config.get("target_hidden_size") or config["hidden_size"]
    return llama


def read_checked_tensors(path: Path, expected: dict[str, tuple[int, ...]], optional: tuple[str, ...] = (),
                         device="cpu") -> dict[str, torch.Tensor]:
    """Read `path` with safetensors, refusing a missing, unexpected or wrongly shaped tensor."""
    check_weights_file(path)
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        names = set(f.keys())
        for name in expected:
            if name not in names and name not in optional:
                raise DraftsmithError(f"{path} has no tensor {name!r}.")
        unexpected = sorted(names - set(expected))
        if unexpected:
            raise DraftsmithError(f"{path} has an unexpected tensor {unexpected[0]!r}.")
        tensors = {}
        for name in sorted(names):
            t = f.get_tensor(name)
            if tuple(t.shape) != tuple(expected[name]):
                raise DraftsmithError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, "
                                      f"expected {tuple(expected[name])}.")
            if name in FIXED_DTYPES and t.dtype != FIXED_DTYPES[name]:
                raise DraftsmithError(f"{path}: tensor {name!r} is {t.dtype}, expected {FIXED_DTYPES[name]}.")
            tensors[name] = t
    return tensors


def keep_rope_fp32(head: torch.nn.Module, inv_freq: torch.Tensor) -> None:
    """Casting the head to bf16 also rounds the rotary frequencies; put the fp32 ones back."""
    rotary = head.get_submodule("rotary_emb")  # every head's LlamaRotaryEmbedding
    device = rotary.get_buffer("inv_freq").device
    rotary.inv_freq = inv_freq.to(device)
    rotary.original_inv_freq = inv_freq.clone().to(device)


def with_target_embeddings(tensors: dict, expected: dict, folder: Path,
                           target_embeddings: torch.Tensor | torch.nn.Embedding | None) -> dict:
    """`tensors` with embed_tokens from `target_embeddings` when the folder has none (checked against its shape)."""
    if EMBED not in tensors:
        if target_embeddings is None:
            raise DraftsmithError(f"{folder / WEIGHTS} has no {EMBED!r}: pass the target's embeddings "
                                  f"as target_embeddings.")
        weight = (target_embeddings.weight if isinstance(target_embeddings, torch.nn.Embedding)
                  else target_embeddings).detach()
        if tuple(weight.shape) != expected[EMBED]:
            raise DraftsmithError(f"target_embeddings has shape {tuple(weight.shape)}, "
                                  f"expected {expected[EMBED]} for {folder}.")
        tensors[EMBED] = weight.to("cpu", tensors["fc.weight"].dtype)
    return tensors


def build_head(cls, config, tensors: dict, device="cpu", dtype: Optional[torch.dtype] = None):
    """`cls(config)` holding `tensors` (strict), moved to device / dtype with its rotary frequencies kept fp32."""
    head = cls(config)
    inv_freq = head.rotary_emb.inv_freq.clone()
    head.to(tensors["fc.weight"].dtype)
    head.load_state_dict(tensors, strict=True)
    head.to(device=device, dtype=dtype)
    keep_rope_fp32(head, inv_freq)
    return head


def target_load_options(folder: Path, target) -> dict:
    """load_<method>(folder, **options) for a head read beside `target` (None: as saved): the target's device,
    dtype and embeddings, once the head is proven made for this target's width."""
    if target is None:
        return {}
    config = read_config_json(folder)
    hidden = config.get("target_hidden_size") or config.get("hidden_size")
    if hidden != target.hidden_size:
        raise DraftsmithError(f"head {folder} reads target hidden size {hidden}, but target {target.target_id!r} "
                              f"has {target.hidden_size}: it was made for another target.")
    return {"device": target.device, "dtype": target.dtype, "target_embeddings": target.model.get_input_embeddings()}


def export_verifier(options, manifest_target: Optional[dict]) -> Optional[str]:
    """The verifier a speculators export names: export's `verifier=`, else the target id in the head's manifest."""
    return options.verifier or (manifest_target or {}).get("target_id")


@dataclass
class FormatOptions:
    """What a method's format writers read (export's and publish's options; eval's llama.cpp bridge builds one too)."""

    dtype: torch.dtype
    include_embeddings: bool = True
    verifier: Optional[str] = None  # speculators: the verifier's HF id or folder
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS  # speculators: the greedy proposal's length (K)
    target_folder: Optional[Callable[[], Path]] = None  # -> the target's HF folder (config + tokenizer), when needed
    gguf_outtype: str = llamacpp.OUTTYPE  # gguf: the file's weight type (llama.cpp's --outtype), not `dtype`

    def target_dir(self) -> Path:
        if self.target_folder is None:
            raise DraftsmithError("this format needs the target's config and tokenizer: pass target_dir=<the "
                                  "target's HF folder>.")
        return self.target_folder()


# The method table's folder hooks (draftsmith.core.methods) over a method's own loader and writers
Loader = Callable[[Path, Any], torch.nn.Module]  # (folder, target | None) -> drafter
Saver = Callable[[torch.nn.Module, Path, dict], Path]  # (drafter, folder, target identity) -> folder
FormatWriter = Callable[[torch.nn.Module, Path, Optional[dict], Any], Path]  # (drafter, out, manifest target, options)


def folder_hooks(load_folder: Callable[..., torch.nn.Module], save_folder: Callable[..., Path]) -> tuple[Loader, Saver]:
    """The `load` and `save` hooks over a method's `load_folder(folder, device=, dtype=, target_embeddings=)` and
    `save_folder(head, folder, manifest_target=)`: beside a target, a head is checked against it and placed as it is."""
    def load(folder: Path, target=None) -> torch.nn.Module:
        return load_folder(folder, **target_load_options(folder, target))

    def save(head: torch.nn.Module, folder: Path, identity: dict) -> Path:
        return save_folder(head, folder, manifest_target=identity)

    return load, save


def export_writer(save_folder: Callable[..., Path]) -> FormatWriter:
    """A format writer over `save_folder(head, folder, manifest_target=, dtype=, include_embeddings=, stage=)`."""
    def write(head: torch.nn.Module, folder: Path, manifest_target: Optional[dict], options) -> Path:
        return save_folder(head, folder, manifest_target=manifest_target, dtype=options.dtype,
                           include_embeddings=options.include_embeddings, stage="export")

    return write


def speculators_writer(save_speculators: Callable[..., Path]) -> FormatWriter:
    """The speculators format writer over `save_speculators(head, folder, verifier=, num_speculative_tokens=, ...)`."""
    def write(head: torch.nn.Module, folder: Path, manifest_target: Optional[dict], options) -> Path:
        return save_speculators(head, folder, verifier=export_verifier(options, manifest_target),
                                num_speculative_tokens=options.num_speculative_tokens, manifest_target=manifest_target,
                                dtype=options.dtype, include_embeddings=options.include_embeddings)

    return write


def weights_sha256(folder: str | os.PathLike) -> str:
    """SHA-256 of the folder's model.safetensors bytes: what eval reports and publish matches a head by."""
    digest = hashlib.sha256()
    with open(check_weights_file(Path(folder) / WEIGHTS), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# format=gguf: llama.cpp

def gguf_writer(save_folder: Callable[..., Path], file_name: str, needs_target: bool = False) -> FormatWriter:
    """format=gguf: the drafter written in its engine folder format by `save_folder(drafter, folder,
    manifest_target, options)` into a temporary folder, then converted by llama.cpp's own converter
    (draftsmith.core.llamacpp) at `options.gguf_outtype` into `out/<file_name>`. `needs_target`: the converter reads
    the target's config and tokenizer (EAGLE-3: `--target-model-dir`, options.target_folder())."""
    def write(drafter: torch.nn.Module, folder: Path, manifest_target: Optional[dict], options) -> Path:
        target_dir = options.target_dir() if needs_target else None
        # the folder in float32 (exact for any weights), so that the converter rounds once, to gguf_outtype
        full = dataclasses.replace(options, dtype=torch.float32)
        with tempfile.TemporaryDirectory(prefix="draftsmith-gguf-") as tmp:
            hf = save_folder(drafter, Path(tmp) / "hf", manifest_target, full)
            with atomic_folder(folder, owner="export") as out:
                gguf = llamacpp.convert(hf, out / file_name, options.gguf_outtype, target_dir)
                if manifest_target is not None:
                    write_manifest(out, "export", manifest_target, {"bytes": gguf.stat().st_size}, format="gguf",
                                   gguf=file_name, gguf_outtype=options.gguf_outtype,
                                   converter=f"llama.cpp {llamacpp.VERSION}-{llamacpp.COMMIT}")
                else:
                    claim_output(out, "export")
        return folder

    return write
