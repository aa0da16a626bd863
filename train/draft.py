"""Draft-model distillation: a small causal LM trained to agree with the target, position by position.

Conventions (sequence x_0 .. x_{T-1}): the draft's logits at position t (it has read x_0..x_t) are
scored against the target's distribution at the same position, on the positions whose next token
x_{t+1} is loss-masked (assistant content, from data-gen). The loss is a weighted mix of
train/losses.py (`method.loss=fkl`, `method.loss='0.7*fkl+0.3*ce'`) at `method.temperature`,
applied to both distributions; `ce` scores the target's sampled token x_{t+1} (data-gen's answer).

Target signal: online, the frozen target runs on each batch under no_grad (its full-vocab
distribution); offline, data-gen's top-k cache (`topk_logits=true`: the k most probable tokens, their
log-probs and the log of the remaining mass), so every divergence is taken over k + 1 outcomes (the k
tokens and the tail): exact when k equals the vocab, a lower bound of the full divergence otherwise.

Logged: each loss term of the mix, acc_0 (draft argmax == target argmax) and alpha_0 =
sum_v min(p_v, q_v) at `method.temperature`: the expected acceptance of one drafted token (offline:
over the k cached tokens only, a lower bound).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ..core import DraftsmithError, checks
from ..core.method_hooks import TrainingHooks
from ..heads.draft import LORA_TARGETS, DraftLM, draft_from_model, draft_from_target, draft_scratch, pick_layers
from . import losses


@dataclass
class LoraOptions:
    """LoRA through PEFT (merged into the weights on save)."""

    enabled: Optional[bool] = None  # None = on for init=from_model, off (full fine-tuning) otherwise
    r: int = 16  # rank
    alpha: int = 32  # scaling numerator (lora_alpha / r)
    dropout: float = 0.0  # dropout on the LoRA input
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # module names adapted

    def __post_init__(self):
        checks.at_least("method.lora.r", self.r, 1)
        checks.positive("method.lora.alpha", self.alpha)
        checks.in_range("method.lora.dropout", self.dropout, 0, 1, high_open=True)
        if not self.target_modules:
            raise DraftsmithError("method.lora.target_modules is empty; name the modules to adapt (e.g. [q_proj,v_proj]).")


@dataclass
class DraftConfig:
    """`method=draft`: the options of draft-model distillation (configs/method/draft.yaml)."""

    name: str = "draft"  # the method (set by method=draft)
    # from_target (the target's embeddings, final norm, lm_head and some of its layers) | from_model | scratch
    init: str = "from_target"
    model: Optional[str] = None  # init=from_model: an HF folder or hub id sharing the target's tokenizer
    num_layers: int = 4  # layers of the draft (from_target, scratch)
    layer_pick: str = "spread"  # from_target: first | every (every N//n-th) | spread (first to last, evenly)
    layers: Optional[list[int]] = None  # from_target: these target layers, in order (overrides the two above)
    hidden_size: Optional[int] = None  # init=scratch: hidden size (None = the target's)
    intermediate_size: Optional[int] = None  # init=scratch: MLP size (None = the target's)
    num_attention_heads: Optional[int] = None  # init=scratch: attention heads (None = the target's)
    num_key_value_heads: Optional[int] = None  # init=scratch: KV heads (None = the target's)
    train_embeddings: bool = False  # full fine-tuning: train the input embeddings too (lm_head always trains)
    loss: str = "fkl"  # fkl | rkl | jsd | tv | ce, or a weighted sum such as '0.5*fkl+0.5*rkl' (train/losses.py)
    temperature: float = 1.0  # applied to draft and target logits alike
    jsd_beta: float = 0.5  # JSD(beta): m = beta p + (1 - beta) q
    lora: LoraOptions = field(default_factory=LoraOptions)

    def __post_init__(self):
        checks.one_of("method.name", self.name, ("draft",))
        checks.one_of("method.init", self.init, ("from_target", "from_model", "scratch"))
        checks.at_least("method.num_layers", self.num_layers, 1)
        checks.one_of("method.layer_pick", self.layer_pick, ("first", "every", "spread"))
        if self.layers is not None and (not self.layers or len(set(self.layers)) != len(self.layers)):
            raise DraftsmithError(f"method.layers={list(self.layers)} must name distinct target layers (or be null).")
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
            checks.at_least(f"method.{key}", getattr(self, key), 1, null="the target's")
            if getattr(self, key) is not None and self.init != "scratch":
                raise DraftsmithError(f"method.{key} sets a size, which only init=scratch can change "
                                      f"(init={self.init} copies weights of that size); drop it or use init=scratch.")
        if self.init == "from_model" and not self.model:
            raise DraftsmithError("method.init=from_model needs method.model=<HF folder or hub id>.")
        parse_loss(self.loss)
        checks.positive("method.temperature", self.temperature)
        checks.in_range("method.jsd_beta", self.jsd_beta, 0, 1, low_open=True, high_open=True)

def lora_kwargs(cfg) -> Optional[dict]:
    """peft.LoraConfig arguments of a DraftConfig (or its composed node), or None for full fine-tuning."""
    on = cfg.lora.enabled if cfg.lora.enabled is not None else cfg.init == "from_model"
    if not on:
        return None
    return {"r": cfg.lora.r, "lora_alpha": cfg.lora.alpha, "lora_dropout": cfg.lora.dropout,
            "target_modules": list(cfg.lora.target_modules)}


def parse_loss(spec: str) -> dict[str, float]:
    """'fkl' -> {fkl: 1}; '0.7*fkl + 0.3*ce' -> {fkl: 0.7, ce: 0.3}."""
    weights: dict[str, float] = {}
    for term in str(spec).replace(" ", "").split("+"):
        m = re.fullmatch(r"(?:([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\*)?([a-z]+)", term)
        if not m or m.group(2) not in losses.LOSSES or m.group(2) in weights:
            raise DraftsmithError(f"method.loss={spec!r} is not a loss of {', '.join(losses.LOSSES)} nor a weighted "
                                  f"sum of distinct ones such as '0.5*fkl+0.5*rkl'.")
        weights[m.group(2)] = float(m.group(1)) if m.group(1) else 1.0
    if sum(weights.values()) <= 0:
        raise DraftsmithError(f"method.loss={spec!r} has no positive weight.")
    return weights


# Columns of the statistics tensor `DraftStep.forward` returns, summed over positions.
STATS = ("count", *(f"loss_{name}" for name in losses.LOSSES), "correct", "alpha_sum")


@dataclass
class TargetLogProbs:
    """What the loss needs from the target at the selected positions (N of them), computed under no_grad."""

    logp: torch.Tensor  # (N, V) full-vocab log-probs, or (N, k + 1) over a top-k cache's tokens and the tail
    ids: Optional[torch.Tensor]  # (N, k) the cached tokens (offline), None for the full vocab
    argmax: torch.Tensor  # (N,) the target's most probable token
    tokens: torch.Tensor  # (N,) the target's sampled next token (the data's)


def select_positions(attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: position t counts when it is real and x_{t+1} is loss-masked (the last position never)."""
    nxt = torch.zeros_like(loss_mask, dtype=torch.bool)
    nxt[:, :-1] = loss_mask[:, 1:].bool() & attention_mask[:, 1:].bool()
    return nxt & attention_mask.bool()


def draft_loss(drafter: DraftLM, input_ids, attention_mask, select, target: TargetLogProbs, weights: dict[str, float],
               temperature: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixed loss of one micro-batch (mean over selected positions) and its statistics (len(STATS),)."""
    hidden = drafter.hidden(input_ids, attention_mask)  # (B, T, H)
    logits = drafter.logits(hidden[select]).float()  # (N, V): only the positions that count
    full = torch.log_softmax(logits / temperature, dim=-1)
    logq = full if target.ids is None else losses.draft_on_topk(logits, target.ids, temperature)
    sampled = full.gather(-1, target.tokens[:, None]).squeeze(-1)  # (N,) log q of the sampled token
    total, terms = losses.mix(weights, target.logp, logq, sampled, beta)
    n = logits.shape[0]
    loss = total.sum() / max(n, 1)
    with torch.no_grad():
        k = logq.shape[-1] - 1 if target.ids is not None else logq.shape[-1]  # the tail is no token
        alpha = losses.acceptance(target.logp[:, :k], logq[:, :k])
        correct = (logits.argmax(-1) == target.argmax).sum()
        nan = logits.new_tensor(float("nan"))  # a loss outside the mix is not computed (nor logged)
        stats = torch.stack([logits.new_tensor(float(n)), *(terms[name].detach().sum() if name in terms else nan
                                                            for name in losses.LOSSES), correct.float(), alpha.sum()])
    return loss, stats


class DraftStep(nn.Module):
    """The trainable module the trainer wraps: the drafter plus its loss (the target stays outside)."""

    def __init__(self, drafter: DraftLM, weights: dict[str, float], temperature: float, beta: float):
        super().__init__()
        self.drafter, self.weights, self.temperature, self.beta = drafter, weights, temperature, beta

    def forward(self, input_ids, attention_mask, loss_mask, select, target: TargetLogProbs):
        return draft_loss(self.drafter, input_ids, attention_mask, select, target, self.weights,
                          self.temperature, self.beta)


def summarize(stats: torch.Tensor) -> dict:
    """Metrics from summed statistics (len(STATS),) (summed over micro-batches / ranks)."""
    s = dict(zip(STATS, stats.double().tolist()))
    n = max(s["count"], 1)
    out = {f"loss_{name}": s[f"loss_{name}"] / n for name in losses.LOSSES
           if not math.isnan(s[f"loss_{name}"])}
    out["acc_0"] = s["correct"] / n
    out["alpha_0"] = s["alpha_sum"] / n
    return out


# ---- the method table's entry points (draftsmith.core.methods) ----------------------------------------

def new_draft(target, cfg: DraftConfig, train, resume: Optional[Path]) -> DraftLM:
    """The draft for `target` as `cfg.init` says (a resumed run loads the checkpoint's weights over it)."""
    cache = getattr(train, "topk", None)
    if cache is not None and abs(cache.temperature - cfg.temperature) > 1e-9:
        raise DraftsmithError(f"the top-k cache of the data was written at temperature {cache.temperature}, but "
                              f"method.temperature={cfg.temperature}; use that temperature, mode=online, or "
                              f"rerun data-gen with topk_temperature={cfg.temperature}.")
    lora = lora_kwargs(cfg)
    if cfg.init == "from_model":
        assert cfg.model is not None  # DraftConfig refuses init=from_model without it
        return draft_from_model(cfg.model, target, lora, cfg.train_embeddings)
    if cfg.init == "scratch":
        sizes = {"num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                 "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
                 "num_key_value_heads": cfg.num_key_value_heads}
        return draft_scratch(target, sizes, lora, cfg.train_embeddings)
    N = target.num_layers
    if cfg.layers is None and cfg.num_layers > N:
        raise DraftsmithError(f"method.num_layers={cfg.num_layers} is more than target {target.target_id!r} has ({N}).")
    layers = list(cfg.layers) if cfg.layers is not None else pick_layers(N, cfg.num_layers, cfg.layer_pick)
    return draft_from_target(target, layers, lora, cfg.train_embeddings)


def draft_training(drafter: DraftLM, target, cfg: DraftConfig, mode: str,
                   autocast: Callable) -> tuple[DraftStep, Callable[[dict], dict]]:
    """(the module to train, `prepare(batch)`): prepare adds the target side at the selected positions
    under no_grad: online the target runs, offline the batch carries data-gen's top-k cache."""
    T = cfg.temperature
    model = target.model if mode == "online" else None  # offline needs nothing of the target

    def prepare(batch: dict) -> dict:
        with torch.no_grad():
            select = select_positions(batch["attention_mask"], batch["loss_mask"])
            tokens = batch["input_ids"][:, 1:][select[:, :-1]]  # (N,) x_{t+1}
            if model is not None:
                with autocast():
                    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                         use_cache=False).last_hidden_state
                    logits = model.get_output_embeddings()(hidden[select])  # (N, V)
                logp = torch.log_softmax(logits.float() / T, dim=-1)
                side = TargetLogProbs(logp, None, logp.argmax(-1), tokens)
            else:
                ids = batch.pop("topk_ids")[select].long()  # (N, k), most probable first
                logp = losses.with_tail(batch.pop("topk_logp")[select].float(), batch.pop("topk_tail")[select].float())
                side = TargetLogProbs(logp, ids, ids[:, 0], tokens)
            for key in ("aux", "last"):
                batch.pop(key, None)
            return {**batch, "select": select, "target": side}

    return DraftStep(drafter, parse_loss(cfg.loss), T, cfg.jsd_beta), prepare


# the method table's hooks (draftsmith.core.method_hooks); mode=offline reads the target's top-k logits
HOOKS = TrainingHooks(config=DraftConfig, offline_data="topk_logits", new_drafter=new_draft, training=draft_training,
                      summarize=summarize)
