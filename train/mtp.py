"""The MTP training step: the target's own MTP layer fine-tuned over K teacher-forced recursive steps.

Conventions (index t of a sequence x_0 .. x_{T-1}; h_t = the hidden state the engine feeds the layer at position t,
heads/mtp.py `engine_hidden`, from the target's hidden_states[N]):

    step 0:  row t reads h_t and x_{t+1} at position t                 -> o_0[t], drafts x_{t+2}
    step k:  row t reads o_{k-1}[t] and x_{t+k+1} (the data's token:    -> o_k[t], drafts x_{t+k+2}
             teacher forcing) at position t+k
    target of row t at step k: softmax(the target's logits at position t+k+1) over the full vocab
    counted (t, k): t+k+1 < T and loss_mask & attention_mask at t+k+1

Attention, as at inference (heads/mtp.py: one KV cache, step-0 keys over the verified positions, then one key per
drafted token): row t at step k sees the step-0 keys of rows <= t and its own keys of steps 1 .. k.

Loss: L = sum_k w_k * mean over counted (t, k) of soft-CE(target probs, layer log-probs), w_k = step_decay^k / sum_j
step_decay^j (FastMTP: step_decay = 0.6, its weights normalised to one). The target, its embeddings and lm_head stay
frozen: the drafter holds only the MTP layers (heads/mtp.py MTPDrafter) and borrows the rest. Logged per step:
loss, accuracy, alpha_k = sum_v min(p_v, q_v) and the chain columns, so E[tau] at K = steps comes out of
train/stats.py as for EAGLE-3.

The layer is the target's own (`model.mtp_layers.*` of a MiMo folder, read from its safetensors) or, where the target
has none (a Llama or Qwen2), a fresh one grafted on, which export's format=mimo writes into a MiMo copy of the target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..core import DraftsmithError, checks
from ..core.engine import NUM_SPECULATIVE_TOKENS, served_folder
from ..core.method_hooks import TrainingHooks
from ..heads.kit import ConcatKVCache
from ..heads.mtp import MTPDrafter, init_mtp_layer, mtp_config_from_target
from ..heads.mtp_folders import ENGINE_INPUTS, MIMO_ARCHITECTURE, claims, load_mtp
from .features import TargetSide, target_prepare
from .stats import CHAIN_STATS, STEP_STATS, summarize_steps

STATS = STEP_STATS + CHAIN_STATS
OFFLINE_DATA = "hidden_states"  # what mode=offline reads from a data-gen folder: hidden_states[N] (aux_layer_ids)


@dataclass
class MTPConfig:
    """`method=mtp`: the options of MTP fine-tuning (configs/method/mtp.yaml)."""

    name: str = "mtp"  # the method (set by method=mtp)
    steps: int = NUM_SPECULATIVE_TOKENS  # K: teacher-forced recursive steps of the layer (the drafted tokens)
    step_decay: float = 0.8  # loss weight of step k is step_decay**k, normalised (FastMTP: 0.6)
    num_layers: int = 1  # MTP layers grafted onto a target that has none (vLLM serves the first)

    def __post_init__(self):
        checks.one_of("method.name", self.name, ("mtp",))
        checks.at_least("method.steps", self.steps, 1)
        checks.positive("method.step_decay", self.step_decay)
        checks.at_least("method.num_layers", self.num_layers, 1)


def step_mask(T: int, k: int, device=None) -> torch.Tensor:
    """(1, 1, T, (k+1)T) bool over the keys [step 0 | step 1 | ... | step k]: causal over step 0, the same row in
    later steps."""
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([torch.ones(T, T, dtype=torch.bool, device=device).tril()] + [eye] * k, dim=1)[None, None]


def shifted(input_ids: torch.Tensor, by: int) -> torch.Tensor:
    """(B, T): row t holds x_{t+by}, 0 past the end (such rows never count)."""
    out = torch.zeros_like(input_ids)
    out[:, : max(input_ids.shape[1] - by, 0)] = input_ids[:, by:]
    return out


def mtp_unroll(drafter: MTPDrafter, input_ids: torch.Tensor, hidden: torch.Tensor, steps: int):
    """Yield each step's output (B, T, H): row t of step k read x_{t+k+1} at position t+k and the previous step's
    output (step 0: `hidden`, the engine's h_t), attending as at inference (`step_mask`)."""
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    cache = ConcatKVCache()
    dtype = hidden.dtype
    for k in range(steps):
        embeds = drafter.embed(shifted(input_ids, k + 1)).to(dtype)  # row t: x_{t+k+1}
        pos = positions + k
        cos, sin = drafter.rotary_emb(hidden, pos)
        hidden = drafter.layers[0](embeds, hidden, pos, cos, sin, step_mask(T, k, input_ids.device), cache)
        yield hidden


def mtp_loss(drafter: MTPDrafter, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
             aux: torch.Tensor, target: TargetSide, steps: int, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of one micro-batch and its statistics (steps, len(STATS)) for logging."""
    B, T = input_ids.shape
    device = input_ids.device
    valid = loss_mask.bool() & attention_mask.bool()  # (B, T): positions whose target counts
    hidden = drafter.engine_hidden(aux.to(drafter.layers[0].input_proj.weight.dtype))  # (B, T, H)
    weights = [decay ** k for k in range(steps)]
    loss = hidden.new_zeros((), dtype=torch.float32)
    chain_ok = torch.ones(B, T, dtype=torch.bool, device=device)
    chain_correct = torch.ones(B, T, dtype=torch.float32, device=device)
    chain_alpha = torch.ones(B, T, dtype=torch.float32, device=device)
    stats = []
    for k, out in enumerate(mtp_unroll(drafter, input_ids, hidden, steps)):
        counted = torch.zeros_like(valid)
        counted[:, : max(T - k - 1, 0)] = valid[:, k + 1:]  # row t's target at t+k+1 counts
        b_i, t_i = torch.nonzero(counted, as_tuple=True)  # (M,) the counted rows only: logits of no others
        logits = drafter.logits(out[b_i, t_i]).float()  # (M, V)
        p = target.probs[b_i, t_i + k + 1]  # (M, V)
        ce = F.cross_entropy(logits, p, reduction="none")  # (M,) soft cross-entropy
        n = ce.new_tensor(float(ce.numel()))
        loss = loss + weights[k] / sum(weights) * ce.sum() / n.clamp(min=1)
        with torch.no_grad():
            q = torch.softmax(logits, dim=-1)
            correct = (logits.argmax(-1) == target.argmax[b_i, t_i + k + 1]).float()  # (M,)
            alpha = torch.minimum(q, p * target.in_mass[b_i, t_i + k + 1, None]).sum(-1)  # (M,)
            chain_ok &= counted
            chain_correct[b_i, t_i] *= correct
            chain_alpha[b_i, t_i] *= alpha
            chain_correct *= counted
            chain_alpha *= counted
            stats.append(torch.stack([ce.detach().sum(), n, correct.sum(), alpha.sum(), n, n.new_zeros(()),
                                      chain_correct.sum(), chain_alpha.sum(), chain_ok.sum().float()]))
    return loss, torch.stack(stats)  # stats columns: STATS, one row per step


class MTPStep(nn.Module):
    """The trainable module the trainer wraps: the MTP layers plus their loss (the target stays outside).

    forward(batch) -> (loss, stats); `prepare` adds aux (hidden_states[N]) and the TargetSide over the full vocab."""

    def __init__(self, drafter: MTPDrafter, steps: int, decay: float):
        super().__init__()
        self.drafter, self.steps, self.decay = drafter, steps, decay

    def forward(self, input_ids, attention_mask, loss_mask, aux, target: TargetSide):
        return mtp_loss(self.drafter, input_ids, attention_mask, loss_mask, aux, target, self.steps, self.decay)


# ---- the method table's entry points (draftsmith.core.methods) ----------------------------------------

def target_mtp_folder(target) -> Optional[Path]:
    """The target's folder when it ships MTP layers (a MiMo folder), else None."""
    try:
        folder = Path(served_folder(target, "method=mtp"))
    except DraftsmithError:  # a preset with no folder of its own (tiny)
        return None
    path = folder / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    arch = (config.get("architectures") or [None])[0]
    return folder if arch == MIMO_ARCHITECTURE and claims(config) else None


def new_mtp(target, cfg: MTPConfig, train, resume: Optional[Path]) -> MTPDrafter:
    """The target's own MTP layers (read from its safetensors), or `num_layers` fresh ones grafted on (computed as
    the MiMo vLLM serves after export format=mimo); trainable, attached to the frozen target. On resume the trainer
    loads the checkpoint's weights into it."""
    folder = target_mtp_folder(target)
    if folder is not None:
        drafter = load_mtp(folder)  # the checkpoint's tensors; attached and placed below
    else:
        hidden, fusion = ENGINE_INPUTS[MIMO_ARCHITECTURE]
        config = mtp_config_from_target(target.model.config, cfg.num_layers, hidden, fusion)
        config.target_architecture = MIMO_ARCHITECTURE  # what it is served as
        drafter = MTPDrafter(config)
        for layer in drafter.layers:
            init_mtp_layer(layer)  # torch's generator, which the run seeds
    # fp32 master weights whatever the target's dtype, as every other method's head (precision=bf16 computes under
    # autocast): in a bf16 target's dtype Adam's updates round away, a norm weight of 1 moves in steps of 2^-7, more
    # than a whole step at lr 3e-3
    drafter.attach(target.model).to(device=target.device, dtype=torch.float32)
    return drafter.requires_grad_(True)


def mtp_training(drafter: MTPDrafter, target, cfg: MTPConfig, mode: str,
                 autocast: Callable) -> tuple[MTPStep, Callable[[dict], dict]]:
    """(the module to train, `prepare(batch)`): prepare adds the target side under no_grad (hidden_states[N] and the
    target's distributions over its whole vocab)."""
    every_token = torch.ones(target.vocab_size, dtype=torch.bool)
    return MTPStep(drafter, cfg.steps, cfg.step_decay), target_prepare(every_token, target, mode, autocast)


summarize = partial(summarize_steps, columns=STATS)  # metrics and E[tau] from the summed statistics
# the method table's hooks (draftsmith.core.method_hooks)
HOOKS = TrainingHooks(config=MTPConfig, offline_data=OFFLINE_DATA, new_drafter=new_mtp, training=mtp_training,
                      summarize=summarize)
