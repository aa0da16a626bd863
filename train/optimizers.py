"""The optimizer the trainer steps (`optimizer=`): AdamW over every trainable parameter (the default), or Muon.

    optimizer=adamw   torch.optim.AdamW(lr, betas, weight_decay)
    optimizer=muon    torch.optim.Muon over the 2-D weight matrices (lr = muon_lr or lr, momentum = muon_momentum,
                      weight_decay = muon_weight_decay, 5 Newton-Schulz steps, adjust_lr_fn="match_rms_adamw") and
                      AdamW as above over everything else: speculators 0.9's split and defaults
                      (speculators/train/optimizers.py `split_named_params_for_muon`, train/config/schema.py)

Muon and AdamW are held as ONE `torch.optim.Optimizer` (`MuonWithAdamW`), so that the trainer's one LR schedule
scales both (each group from its own peak, as speculators' one scheduler per optimizer does) and its one optimizer
state dict goes into the checkpoint as safetensors + JSON (train/checkpoint.py `save_optimizer`): resume is exact.
Muon needs whole matrices, so it runs with plain torch (DDP with several processes), never under ZeRO, which flattens
and partitions them (train/config.py refuses it; deepspeed=auto resolves to none).
"""

from __future__ import annotations

import torch
from torch import nn

# 2-D weights that stay with AdamW, as in speculators 0.9 (and Keller Jordan's Muon): embeddings and output heads
ADAMW_MATRICES = ("embed_tokens", "lm_head")
MUON_NS_STEPS = 5  # Newton-Schulz iterations (speculators' and torch's default)
MUON_ADJUST_LR = "match_rms_adamw"  # Muon's update RMS matched to AdamW's, so AdamW's lr and decay carry over


def split_for_muon(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's) trainable parameters: Muon takes the 2-D matrices with both sides > 1 that are not an
    embedding or an output head (speculators 0.9's rule); AdamW the rest (norms, lm_head, a [1, N] vector)."""
    muon: list[nn.Parameter] = []
    adamw: list[nn.Parameter] = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        matrix = p.ndim == 2 and min(p.shape) > 1 and not any(hint in name for hint in ADAMW_MATRICES)
        (muon if matrix else adamw).append(p)
    return muon, adamw


class MuonWithAdamW(torch.optim.Optimizer):
    """torch's Muon over `muon_params` and AdamW over `adamw_params`, as one optimizer.

    Its param_groups are the inner optimizers' own group dicts (Muon's first), so a scheduler's lr reaches them, and
    its state is the one dict both inner optimizers write (keyed by parameter): state_dict / load_state_dict are the
    base class's, over both."""

    def __init__(self, muon_params: list, adamw_params: list, *, lr: float, betas: tuple[float, float],
                 weight_decay: float, muon_lr: float, muon_momentum: float, muon_weight_decay: float):
        self.parts: list[torch.optim.Optimizer] = []  # the inner optimizers that have parameters
        if muon_params:
            self.parts.append(torch.optim.Muon(muon_params, lr=muon_lr, momentum=muon_momentum,
                                               weight_decay=muon_weight_decay, ns_steps=MUON_NS_STEPS,
                                               adjust_lr_fn=MUON_ADJUST_LR))
        if adamw_params:
            self.parts.append(torch.optim.AdamW(adamw_params, lr=lr, betas=betas, weight_decay=weight_decay))
        super().__init__([group for part in self.parts for group in part.param_groups], {})
        self._share()

    def _share(self) -> None:
        """Point each inner optimizer at its slice of our param_groups and at our state (again after a load, which
        replaces both)."""
        start = 0
        for part in self.parts:
            n = len(part.param_groups)
            part.param_groups, part.state = self.param_groups[start:start + n], self.state
            start += n

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()


def build_optimizer(module: nn.Module, cfg) -> torch.optim.Optimizer:
    """The optimizer of `module`'s trainable parameters that `cfg.optimizer` names (see the module docstring)."""
    if cfg.optimizer == "muon":
        muon, adamw = split_for_muon(module)
        return MuonWithAdamW(muon, adamw, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                             muon_lr=cfg.muon_lr if cfg.muon_lr is not None else cfg.lr,
                             muon_momentum=cfg.muon_momentum, muon_weight_decay=cfg.muon_weight_decay)
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
