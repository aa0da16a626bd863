"""The draft model: a small causal LM sharing the target's tokenizer, and its plain HF folder.

    DraftLM(DraftLMConfig)      the trainable drafter: an HF causal LM built from its config,
                                PEFT LoRA-wrapped when `lora` is set; `type(d)(d.config)` rebuilds
                                the same structure (what the trainer's final save and checkpoints need)
    draft_from_target(...)      the target's embeddings, final norm, lm_head and a subset of its layers
    draft_from_model(...)       a given small HF model, refused unless it shares the target's tokenizer

Its folder (save, load, export, the card) is heads/draft_folders.py.

Embeddings and lm_head are untied in the drafter (a tied pair shares memory, which safetensors
refuses to write twice, and the draft may train its lm_head while keeping the target's embeddings).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ..core import DraftsmithError
from ..core.trust import check_weights_file, remote_code_refused
from .folders import WEIGHTS

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class CausalLM(Protocol):
    """What DraftLM reads of its HF causal LM (LoRA-wrapped or not): the decoder stack and the output embeddings."""

    model: nn.Module

    def get_output_embeddings(self) -> nn.Module: ...


@dataclass
class DraftLMConfig:
    """What rebuilds a DraftLM: the HF config, the LoRA settings, and what its folder carries besides weights."""

    model_config: Any  # transformers PretrainedConfig of the draft (tie_word_embeddings False)
    lora: Optional[dict] = None  # peft.LoraConfig keyword arguments; None = full fine-tuning
    train_embeddings: bool = False  # full fine-tuning: train the input embeddings too
    tokenizer: Any = None  # the target's tokenizer, saved beside the weights
    generation_config: Any = None  # the target's generation config (eos ids), saved beside the weights
    source: str = ""  # where the weights came from, for the manifest


class DraftLM(nn.Module):
    """An HF causal LM (optionally PEFT LoRA-wrapped) built from a DraftLMConfig; weights are random until loaded."""

    def __init__(self, config: DraftLMConfig):
        super().__init__()
        self.config = config
        self.lm = AutoModelForCausalLM.from_config(config.model_config, dtype=torch.float32)
        if config.lora is not None:
            self._wrap(config.lora)
        elif not config.train_embeddings:
            self.lm.get_input_embeddings().weight.requires_grad_(False)

    def _wrap(self, lora: dict) -> None:
        from peft import LoraConfig, get_peft_model

        self.lm = get_peft_model(self.lm, LoraConfig(task_type="CAUSAL_LM", **lora))  # freezes all but LoRA

    def add_lora(self, lora: dict) -> None:
        """Wrap the (loaded) weights with fresh LoRA adapters; the config records it, so a rebuild matches."""
        self.config.lora = dict(lora)
        self._wrap(self.config.lora)

    def base(self) -> CausalLM:
        """The HF causal LM (LoRA layers injected in place when wrapped)."""
        return self.lm.get_base_model() if self.config.lora is not None else self.lm

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden states (B, T, H)."""
        out = self.base().model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.base().get_output_embeddings()(hidden)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits (B, T, V)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self.logits(self.hidden(input_ids, attention_mask))

    def merged(self) -> PreTrainedModel:
        """A plain HF causal LM with the LoRA weights merged in (a copy; this module is unchanged)."""
        lm = copy.deepcopy(self.lm)
        if self.config.lora is not None:
            lm = lm.merge_and_unload()
        for p in lm.parameters():
            p.requires_grad_(True)
        if self.config.generation_config is not None:
            lm.generation_config = copy.deepcopy(self.config.generation_config)
        return lm.eval()


# ---- building a draft ----------------------------------------------------------------------------

def pick_layers(num_target_layers: int, n: int, how: str) -> list[int]:
    """Which target layers a draft of n layers copies: first (0..n-1), every (every N//n-th from 0)
    or spread (evenly from the first to the last)."""
    N = num_target_layers
    if how == "first":
        return list(range(n))
    if how == "every":
        return [i * (N // n) for i in range(n)]
    if n == 1:
        return [N - 1]
    return sorted({round(i * (N - 1) / (n - 1)) for i in range(n)})


def untied_config(config, **changes):
    """A copy of an HF config with untied embeddings and `changes` applied."""
    config = copy.deepcopy(config)
    config.tie_word_embeddings = False
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def draft_from_target(target, layers: list[int], lora: Optional[dict], train_embeddings: bool) -> DraftLM:
    """A draft of `layers` (target layer indices, in order) with the target's embeddings, norm and lm_head."""
    mc = target.model.config
    N = mc.num_hidden_layers
    bad = [i for i in layers if not 0 <= i < N]
    if bad:
        raise DraftsmithError(f"method.layers has {bad[0]}, but target {target.target_id!r} has layers 0..{N - 1}.")
    changes: dict[str, object] = {"num_hidden_layers": len(layers)}
    if isinstance(getattr(mc, "layer_types", None), list):
        changes["layer_types"] = [mc.layer_types[i] for i in layers]
    config = untied_config(mc, **changes)
    source = target.model.state_dict()
    state = {}
    for name, t in source.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            if int(i) in layers:
                state[f"model.layers.{layers.index(int(i))}.{rest}"] = t
        else:
            state[name] = t
    state.setdefault("lm_head.weight", source["model.embed_tokens.weight"])
    return _built(config, state, target, lora, train_embeddings, f"target {target.target_id} layers {layers}")


def draft_scratch(target, sizes: dict, lora: Optional[dict], train_embeddings: bool) -> DraftLM:
    """A randomly initialised draft in the target's config family, with `sizes` (hidden_size, ...) changed."""
    changes = {k: v for k, v in sizes.items() if v is not None}
    config = untied_config(target.model.config, **changes)
    if "hidden_size" in changes or "num_attention_heads" in changes:
        config.head_dim = config.hidden_size // config.num_attention_heads
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:config.num_hidden_layers]
    return DraftLM(DraftLMConfig(config, lora, train_embeddings, target.tokenizer,
                                 copy.deepcopy(target.model.generation_config), "scratch"))


def check_same_tokenizer(tokenizer, vocab_size: int, name: str, target) -> None:
    """Refuse a draft whose tokenizer or vocab differs from the target's, in one sentence naming both."""
    why = None
    if tokenizer.get_vocab() != target.tokenizer.get_vocab():
        why = f"its tokenizer has {len(tokenizer)} tokens with other ids, the target's {len(target.tokenizer)}"
    elif vocab_size != target.vocab_size:
        why = f"its vocab_size is {vocab_size}, the target's {target.vocab_size}"
    if why:
        raise DraftsmithError(f"draft model {name!r} does not share the tokenizer of target {target.target_id!r} "
                              f"({why}); a draft must use the target's tokenizer and vocab.")


DRAFT_CODE_FIX = ("draftsmith never runs a draft model's own code: use a draft model whose architecture and tokenizer "
                  "transformers supports natively")


def check_draft_weights(folder: Path, *, links_ok: bool = False) -> list[Path]:
    """A draft-model folder's safetensors files (one, or the shards of one model), each checked by
    core.trust.check_weights_file (which also refuses a folder holding only pickled weights)."""
    files = sorted(folder.glob("*.safetensors")) or [folder / WEIGHTS]
    return [check_weights_file(f, links_ok=links_ok) for f in files]


def draft_from_model(name: str, target, lora: Optional[dict], train_embeddings: bool) -> DraftLM:
    """A draft initialised from the HF causal LM `name` (folder or hub id), which must share the target's tokenizer."""
    if Path(name).is_dir():
        check_draft_weights(Path(name), links_ok=True)  # a folder of the user's own (a Hub cache snapshot is links)
    try:
        with remote_code_refused(name, "draft model", DRAFT_CODE_FIX):
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, use_safetensors=True,
                                                         trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise DraftsmithError(f"method.model={name!r} could not be loaded as an HF causal LM "
                              f"({str(e).splitlines()[0]}).") from None
    check_same_tokenizer(tokenizer, model.config.vocab_size, name, target)
    state = model.state_dict()
    state.setdefault("lm_head.weight", model.get_input_embeddings().weight)
    return _built(untied_config(model.config), state, target, lora, train_embeddings, name)


def _built(config, state: dict, target, lora, train_embeddings: bool, source: str) -> DraftLM:
    """A DraftLM of `config` holding `state` (an HF causal LM's state dict; every key checked)."""
    drafter = DraftLM(DraftLMConfig(config, None, train_embeddings, target.tokenizer,
                                    copy.deepcopy(target.model.generation_config), source))
    drafter.lm.load_state_dict({k: v.detach().float() for k, v in state.items()}, strict=True)
    if lora is not None:
        drafter.add_lora(lora)
    return drafter
