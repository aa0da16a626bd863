"""The folders of a target's own MTP layers: read from the target's safetensors, trained, and stitched back.

transformers drops MTP tensors on load (its main classes ignore them), so they are read and written here from the
safetensors files directly, under the names vLLM's MiMoMTP loads (`mimo_mtp.py` load_weights):

    model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, input_layernorm,
                          self_attn.{q,k,v}_proj.{weight,bias}, self_attn.o_proj.weight,
                          post_attention_layernorm, mlp.{gate,up,down}_proj, final_layernorm}

Three folders:
    a MiMo target     `architectures: ["MiMoForCausalLM"]`, `num_nextn_predict_layers` >= 1: vLLM serves its MTP
                      layers with `{"method": "mtp"}`; eval reads them untrained (`head=mtp`, the same as
                      `head=<that folder>`)
    train's output    config.json `DraftsmithMTP` (the MTP layers' Qwen2 config, their input and fusion, the target's
                      architecture) and model.safetensors holding only the MTP tensors
    format=mimo       export's stitch: a copy of the target folder in which only the MTP tensors and the config's MTP
                      fields change (a MiMo target, every shape checked against the target's own MTP tensors); a
                      Llama or Qwen2 target without MTP layers is converted into a MiMo (`save_as_mimo`): its tensors
                      unchanged, zero q/k/v biases for a Llama, the new MTP layers beside them
Every folder is written atomically (a hidden sibling renamed into place) and only where the stage may write.
"""

from __future__ import annotations

import json
import os
import shutil
import types
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from ..core import DraftsmithError
from ..core.artifacts import atomic_folder, atomic_write_json, claim_output, write_manifest
from ..core.method_hooks import FolderHooks
from ..core.trust import check_weights_file
from .folders import CONFIG, WEIGHTS, read_config_json, write_safetensors
from .mtp import MTP_FIELDS, MTPDrafter, init_mtp_layer, mtp_config_from_target

MIMO_ARCHITECTURE = "MiMoForCausalLM"  # vLLM 0.32 maps it to MiMoMTP for method mtp
MTP_ARCHITECTURE = "DraftsmithMTP"  # train's output: the MTP layers alone
ARCHITECTURES = (MIMO_ARCHITECTURE, MTP_ARCHITECTURE)
MTP_PREFIX = "model.mtp_layers."
INDEX = "model.safetensors.index.json"
# what vLLM 0.32 feeds the MTP layer of each architecture it serves from here: (hidden state, fusion order)
ENGINE_INPUTS = {MIMO_ARCHITECTURE: ("pre_norm", "hidden_first")}
CONVERTIBLE = ("LlamaForCausalLM", "Qwen2ForCausalLM")  # targets saved as a MiMo with a grafted MTP layer
# tensors copied beside the weights when a folder is stitched (the target's tokenizer and generation settings)
TARGET_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def layer_shapes(config) -> dict[str, tuple[int, ...]]:
    """One MTP layer's tensors (names under `model.mtp_layers.{i}.`) and shapes."""
    H, I, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return {"token_layernorm.weight": (H,), "hidden_layernorm.weight": (H,), "input_proj.weight": (H, 2 * H),
            "input_layernorm.weight": (H,), "self_attn.q_proj.weight": (q, H), "self_attn.q_proj.bias": (q,),
            "self_attn.k_proj.weight": (kv, H), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.weight": (kv, H),
            "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.weight": (H, q), "post_attention_layernorm.weight": (H,),
            "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
            "final_layernorm.weight": (H,)}


def mtp_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every MTP tensor of the folder (full checkpoint names) and its shape."""
    return {f"{MTP_PREFIX}{i}.{name}": shape for i in range(config.num_nextn_predict_layers)
            for name, shape in layer_shapes(config).items()}


def mtp_tensors(drafter: MTPDrafter, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """The drafter's MTP tensors under the checkpoint's names, contiguous on the CPU, in `dtype`."""
    return {f"model.mtp_{name}": t.detach().to("cpu", dtype or t.dtype).contiguous()
            for name, t in drafter.state_dict().items()}  # layers.{i}.x -> model.mtp_layers.{i}.x


# ---- reading a folder ---------------------------------------------------------------------------------------

def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: model.safetensors, or the shards its index names."""
    index = folder / INDEX
    if (folder / WEIGHTS).is_file() or not index.is_file():
        return [check_weights_file(folder / WEIGHTS)]
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
        raise DraftsmithError(f"{index} is not a safetensors index (no weight_map).") from None
    if any(Path(n).name != n for n in names):
        raise DraftsmithError(f"{index} names a weights file outside its folder.")
    return [check_weights_file(folder / n) for n in names]


def tensor_names(folder: Path) -> set[str]:
    """The names of every tensor in the folder's weights files (headers only)."""
    names: set[str] = set()
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def read_tensors(folder: Path, keep) -> dict[str, torch.Tensor]:
    """The folder's tensors whose names `keep(name)` accepts, from every weights file."""
    out = {}
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if keep(name):
                    out[name] = f.get_tensor(name)
    return out


def check_mtp_tensors(tensors: dict[str, torch.Tensor], config, where: Path) -> None:
    """Refuse a missing, unexpected or wrongly shaped MTP tensor, naming it and `where`."""
    expected = mtp_shapes(config)
    if not tensors:  # a config that declares MTP layers over weights without them (a checkpoint saved by transformers)
        raise DraftsmithError(f"{where} ships no MTP layer: its config.json declares num_nextn_predict_layers "
                              f"{config.num_nextn_predict_layers}, but its weights hold no {MTP_PREFIX}* tensor.")
    for name, shape in expected.items():
        if name not in tensors:
            raise DraftsmithError(f"{where} has no tensor {name!r} (num_nextn_predict_layers "
                                  f"{config.num_nextn_predict_layers}).")
        if tuple(tensors[name].shape) != shape:
            raise DraftsmithError(f"{where}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}.")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise DraftsmithError(f"{where} has an unexpected MTP tensor {extra[0]!r}.")


def config_of(config: dict, where: Path):
    """The MTP layers' config from a folder's config.json (a MiMo target's, or train's output)."""
    arch = (config.get("architectures") or [None])[0]
    required = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "rms_norm_eps", "max_position_embeddings", "num_hidden_layers", "num_nextn_predict_layers")
    for key in required:
        if key not in config:
            raise DraftsmithError(f"{where / CONFIG} has no {key!r}.")
    if not isinstance(config["num_nextn_predict_layers"], int) or config["num_nextn_predict_layers"] < 1:
        raise DraftsmithError(f"{where / CONFIG} has num_nextn_predict_layers="
                              f"{config['num_nextn_predict_layers']!r}: it ships no MTP layer.")
    engine_arch = config.get("target_architecture", arch) if arch == MTP_ARCHITECTURE else arch
    hidden, fusion = ENGINE_INPUTS.get(engine_arch, (None, None))
    hidden, fusion = config.get("mtp_hidden", hidden), config.get("mtp_fusion", fusion)
    if hidden is None or fusion is None:
        raise DraftsmithError(f"{where / CONFIG}: no engine input is known for architecture {engine_arch!r} "
                              f"(draftsmith reads MTP layers of {', '.join(ENGINE_INPUTS)}).")
    fields = {k: config[k] for k in required[:-1]}
    fields.update(head_dim=config.get("head_dim"), hidden_act=config.get("hidden_act", "silu"),
                  rope_parameters=config.get("rope_parameters") or {"rope_type": "default",
                                                                    "rope_theta": config.get("rope_theta", 10000.0)})
    mtp = mtp_config_from_target(types.SimpleNamespace(**fields), config["num_nextn_predict_layers"], hidden, fusion)
    mtp.target_architecture = engine_arch
    return mtp


def claims(config: dict) -> bool:
    """A MiMo folder is the mtp method's only when it ships MTP layers (train's output always does)."""
    return (config.get("architectures") or [None])[0] == MTP_ARCHITECTURE or \
        int(config.get("num_nextn_predict_layers") or 0) >= 1


def load_mtp(folder: str | os.PathLike, target=None) -> MTPDrafter:
    """The MTP layers of a MiMo folder or of train's output, every tensor checked; beside a target (a draftsmith
    Target), attached to it and placed on its device and dtype."""
    folder = Path(folder)
    config = config_of(read_config_json(folder), folder)
    tensors = read_tensors(folder, lambda name: name.startswith(MTP_PREFIX))
    check_mtp_tensors(tensors, config, folder)
    drafter = MTPDrafter(config)
    inv_freq = drafter.rotary_emb.inv_freq.clone()
    drafter.load_state_dict({name.removeprefix("model.mtp_"): t for name, t in tensors.items()}, strict=True)
    if target is not None:
        drafter.attach(target.model)
        drafter.to(device=target.device, dtype=target.dtype)
        drafter.rotary_emb.inv_freq = inv_freq.to(target.device)  # rotary frequencies stay fp32
    return drafter.requires_grad_(False)


# ---- writing ------------------------------------------------------------------------------------------------

def config_json(drafter: MTPDrafter, dtype: torch.dtype) -> dict:
    """train's output config.json: the MTP layers' config, their input and fusion, the target's architecture."""
    config = drafter.config.to_dict()
    config.update(architectures=[MTP_ARCHITECTURE], target_architecture=drafter.config.target_architecture,
                  torch_dtype=str(dtype).removeprefix("torch."),
                  **{k: getattr(drafter.config, k) for k in MTP_FIELDS})
    config.pop("auto_map", None)
    return config


def save_mtp(drafter: MTPDrafter, folder: str | os.PathLike, manifest_target: dict | None = None,
             dtype: Optional[torch.dtype] = None, stage: str = "train") -> Path:
    """train's output: the MTP layers alone (atomically)."""
    tensors = mtp_tensors(drafter, dtype)
    with atomic_folder(Path(folder), owner="export" if stage == "export" else None) as tmp:
        write_safetensors(tmp / WEIGHTS, tensors)
        atomic_write_json(tmp / CONFIG, config_json(drafter, next(iter(tensors.values())).dtype))
        if manifest_target is not None:
            write_manifest(tmp, stage, manifest_target, {"parameters": sum(t.numel() for t in tensors.values())},
                           format="mtp")
    return Path(folder)


def _target_files(target_folder: Path, tmp: Path) -> None:
    for name in TARGET_FILES:
        src = target_folder / name
        if src.is_file() and not src.is_symlink():
            shutil.copyfile(src, tmp / name)


def stitch(drafter: MTPDrafter, target_folder: str | os.PathLike, out: str | os.PathLike,
           manifest_target: dict | None = None, dtype: Optional[torch.dtype] = None, stage: str = "export") -> Path:
    """Write a copy of the MiMo target folder `target_folder` into `out` in which only the MTP tensors (in `dtype`,
    default theirs) and config.json's `num_nextn_predict_layers` change; the target's own MTP tensors must have
    exactly the new ones' names and shapes. A Llama / Qwen2 target without MTP layers is converted instead
    (`convert_to_mimo`)."""
    target_folder = Path(target_folder)
    config = read_config_json(target_folder)
    arch = (config.get("architectures") or [None])[0]
    if arch in CONVERTIBLE and not config.get("num_nextn_predict_layers"):
        return convert_to_mimo(target_folder, out, drafter, manifest_target, dtype, stage)
    if arch != MIMO_ARCHITECTURE:
        raise DraftsmithError(f"{target_folder} declares architectures {config.get('architectures')!r}: format=mimo "
                              f"stitches MTP layers into a {MIMO_ARCHITECTURE} folder or converts a "
                              f"{' or '.join(CONVERTIBLE)} one.")
    own = config_of(config, target_folder)
    new = mtp_tensors(drafter, dtype)
    old = read_tensors(target_folder, lambda name: name.startswith(MTP_PREFIX))
    check_mtp_tensors(old, own, target_folder)  # the target's own layers: complete and of its config's shapes
    for name, t in new.items():
        if name not in old:
            raise DraftsmithError(f"the trained MTP tensor {name!r} has no counterpart in {target_folder} "
                                  f"(num_nextn_predict_layers {own.num_nextn_predict_layers}).")
        if tuple(old[name].shape) != tuple(t.shape):
            raise DraftsmithError(f"the trained MTP tensor {name!r} has shape {tuple(t.shape)}, {target_folder} "
                                  f"holds {tuple(old[name].shape)}: it was trained for another target.")
    if set(old) != set(new):
        raise DraftsmithError(f"{target_folder} has MTP tensor {sorted(set(old) - set(new))[0]!r}, which the trained "
                              f"layers lack (num_nextn_predict_layers {drafter.config.num_nextn_predict_layers}).")
    config = {**config, "num_nextn_predict_layers": drafter.config.num_nextn_predict_layers}
    return _write_target_copy(target_folder, out, new, config, manifest_target, stage)


def _write_target_copy(target_folder: Path, out, mtp: dict[str, torch.Tensor], config: dict,
                       manifest_target: dict | None, stage: str, extra: Optional[dict] = None) -> Path:
    """Every weights file of the target rewritten with its MTP tensors replaced by `mtp` (the new ones go into the
    first file), its other tensors as they are (plus `extra`), config.json as given, the tokenizer files copied."""
    files = weight_files(target_folder)
    with atomic_folder(Path(out), owner="export" if stage == "export" else None) as tmp:
        weight_map = {}
        for n, path in enumerate(files):
            with safe_open(str(path), framework="pt") as f:
                tensors = {name: f.get_tensor(name) for name in f.keys() if not name.startswith(MTP_PREFIX)}
                metadata = f.metadata()
            if n == 0:
                tensors.update(extra or {})
                tensors.update(mtp)
            write_safetensors(tmp / path.name, tensors, metadata)
            weight_map.update({name: path.name for name in tensors})
        if len(files) > 1:
            index = json.loads((target_folder / INDEX).read_text())
            atomic_write_json(tmp / INDEX, {**index, "weight_map": dict(sorted(weight_map.items()))})
        atomic_write_json(tmp / CONFIG, config)
        _target_files(target_folder, tmp)
        if manifest_target is not None:
            write_manifest(tmp, stage, manifest_target, {"mtp_parameters": sum(t.numel() for t in mtp.values())},
                           format="mimo")
        elif stage == "export":
            claim_output(tmp, stage)
    return Path(out)


def mimo_config(config: dict, num_layers: int) -> dict:
    """A Llama / Qwen2 config.json as a MiMo's: Qwen2's model type (transformers reads it as a Qwen2; vLLM reads
    `architectures`), the MTP layer count, lm_head written out (vLLM's MiMoMTP loads `lm_head` from the file)."""
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise DraftsmithError("a Llama target with attention or MLP biases is not a Qwen2 (MiMo's base): it cannot "
                              "be saved as a MiMo.")
    H, heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim") not in (None, H // heads) or H % heads:
        raise DraftsmithError(f"the target's head_dim {config.get('head_dim')} is not hidden_size / "
                              f"num_attention_heads ({H} / {heads}), which a Qwen2 (MiMo's base) assumes.")
    out = {k: v for k, v in config.items() if k not in ("attention_bias", "mlp_bias", "pretraining_tp", "auto_map")}
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    out.update(architectures=[MIMO_ARCHITECTURE], model_type="qwen2", num_nextn_predict_layers=num_layers,
               tie_word_embeddings=False, rope_parameters=rope, rope_theta=rope.get("rope_theta", 10000.0),
               use_sliding_window=False)
    return out


def convert_to_mimo(target_folder: Path, out, drafter: MTPDrafter, manifest_target: dict | None = None,
                    dtype: Optional[torch.dtype] = None, stage: str = "export") -> Path:
    """A Llama / Qwen2 folder saved as a MiMo: its tensors as they are, zero q/k/v biases where it has none (a Llama
    is a Qwen2 with zero biases), lm_head written out when tied, and `drafter`'s MTP layers."""
    config = read_config_json(target_folder)
    new_config = mimo_config(config, drafter.config.num_nextn_predict_layers)
    names = tensor_names(target_folder)
    wanted = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
    tensors = read_tensors(target_folder, lambda name: name.endswith(wanted) or name == "model.embed_tokens.weight")
    extra = {}
    for i in range(config["num_hidden_layers"]):
        for proj in ("q_proj", "k_proj", "v_proj"):
            w = tensors.get(f"model.layers.{i}.self_attn.{proj}.weight")
            if w is None:
                raise DraftsmithError(f"{target_folder} has no tensor 'model.layers.{i}.self_attn.{proj}.weight'.")
            if f"model.layers.{i}.self_attn.{proj}.bias" not in names:
                extra[f"model.layers.{i}.self_attn.{proj}.bias"] = torch.zeros(w.shape[0], dtype=w.dtype)
    if "lm_head.weight" not in names:
        extra["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp = mtp_tensors(drafter, dtype)
    check_mtp_tensors(mtp, mtp_config_from_target(types.SimpleNamespace(**config),
                                                  drafter.config.num_nextn_predict_layers), target_folder)
    return _write_target_copy(target_folder, out, mtp, new_config, manifest_target, stage, extra)


def save_as_mimo(model, folder: str | os.PathLike, drafter: Optional[MTPDrafter] = None, num_layers: int = 1,
                 seed: int = 0) -> Path:
    """A transformers Llama / Qwen2 model written as a MiMo folder (atomically, where nothing else is): its weights,
    zero q/k/v biases for a Llama, lm_head written out, and `drafter`'s MTP layers or `num_layers` fresh ones
    (seeded). What tests and the SmolLM2-as-MiMo target are built from."""
    arch = type(model).__name__
    if arch not in CONVERTIBLE:
        raise DraftsmithError(f"save_as_mimo takes a {' or '.join(CONVERTIBLE)}, not a {arch}.")
    if drafter is None:
        drafter = MTPDrafter(mtp_config_from_target(model.config, num_layers))
        generator = torch.Generator().manual_seed(seed)
        for layer in drafter.layers:
            init_mtp_layer(layer, generator=generator)
    with_mtp_layers = drafter.config.num_nextn_predict_layers
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in model.state_dict().items()}
    for i in range(model.config.num_hidden_layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            w = tensors[f"model.layers.{i}.self_attn.{proj}.weight"]
            tensors.setdefault(f"model.layers.{i}.self_attn.{proj}.bias", torch.zeros(w.shape[0], dtype=w.dtype))
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"].clone())
    tensors.update(mtp_tensors(drafter, next(iter(tensors.values())).dtype))
    config = mimo_config(model.config.to_dict(), with_mtp_layers)
    config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    with atomic_folder(Path(folder), owner="export") as tmp:
        write_safetensors(tmp / WEIGHTS, tensors)
        atomic_write_json(tmp / CONFIG, config)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.to_json_file(str(tmp / "generation_config.json"))
        claim_output(tmp, "export")
    return Path(folder)


# ---- the method table's hooks (draftsmith.core.methods) -------------------------------------------------------

def aux_layer_ids(num_layers: int) -> list[int]:
    """The target's hidden_states[N] (after its final norm): what the MTP layer's input is computed from
    (heads/mtp.py MTPDrafter.engine_hidden)."""
    return [num_layers]


def load(folder: Path, target=None) -> MTPDrafter:
    return load_mtp(folder, target)


def save(drafter: MTPDrafter, folder: Path, identity: dict) -> Path:
    return save_mtp(drafter, folder, manifest_target=identity)


def write_mimo(drafter: MTPDrafter, folder: Path, manifest_target: Optional[dict], options) -> Path:
    """format=mimo: the target folder (export's target_dir, or the head's target) with these MTP layers stitched in."""
    return stitch(drafter, options.target_dir(), folder, manifest_target, options.dtype)


FORMATS = {"mimo": write_mimo}


def card(options: dict, formats: list[str], commands: dict) -> dict:
    """The MTP layers' parts of the card."""
    return {
        "title": "A fine-tuned multi-token-prediction (MTP) layer, stitched into its target",
        "method": ("MTP: the target's own multi-token-prediction layer, fine-tuned with the target, its embeddings "
                   f"and lm_head frozen, over {options['steps']} teacher-forced recursive steps, then written "
                   "back into a copy of the target folder (only the MTP tensors change). vLLM serves it with "
                   "method mtp, the target folder being the model."),
        "tags": ["mtp", "speculative-decoding", "draftsmith", "vllm"],
        "commands": commands,
        "files": {"mimo": f"the target folder with its MTP layers ({MIMO_ARCHITECTURE})"},
    }


HOOKS = FolderHooks(architectures=ARCHITECTURES, formats=FORMATS, load=load, save=save, card=card, claims=claims,
                    aux_layer_ids=aux_layer_ids)
