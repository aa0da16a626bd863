"""The DSpark training step: DFlash's anchors and batched block forward (train/block.py, the layout in
train/dflash.py's docstring), the Markov and confidence heads on every counted slot, DeepSpec's loss.

Slot (a, k), k >= 1, of the block at anchor a drafts x_{a+k}; its target is the target's distribution p at
u = a+k-1 (over the draft vocab, renormalised; m = the target's mass on the draft vocab); its Markov input is the
TRUE previous token x_{a+k-1} = x_u (teacher forced: x_a for k = 1, the bonus token). With q = softmax(logits_k)
(the Markov bias added, heads/dspark.py) and c = sigmoid(confidence logit):

    L1_k  = sum_{v in draft} |q_v - m p_v| + (1 - m)    the L1 distance over the TARGET vocab (q is 0 outside the
                                                        draft vocab, where the target has 1 - m), so that
    1 - L1_k / 2 = 1 - TV_k = sum_v min(q_v, m p_v)     is exactly the acceptance probability the verifier realises
    CE_k  = -log q_y, y = x_{a+k} the data's next token (`ce=token`, DeepSpec's; a slot whose y is outside the draft
            vocab or past the row has no CE term), or -sum_v p_v log q_v (`ce=soft`, draftsmith's soft CE)
    BCE_k = -(t log c + (1 - t) log(1 - c)),  t = 1 - TV_k, detached (the confidence learns the acceptance; it
            does not pull the drafter)

    w_k   = exp(-(k-1) / slot_decay)   the first drafted slot weighs 1 (DeepSpec's exp(-j/gamma) over its draft
            slots j = 0, 1, ..; DFlash's exp_decay)
    L     = ce_weight * sum w CE / sum w  +  l1_weight * sum w L1 / sum w  +  confidence_weight * sum w BCE / sum w

each sum over the counted slots whose target argmax is in the draft vocab (DFlash's rule; the CE sums also skip a slot
without a token). DeepSpec's defaults: 0.1, 0.9, 1.0, slot_decay 4.

Logged per block position k = 1 .. B-1 (train/stats.py's STEP_STATS + CHAIN_STATS, as DFlash, with the slot's loss
ce_weight CE + l1_weight L1 + confidence_weight BCE and alpha = 1 - TV), plus the confidence's BCE, its mean and its
mean absolute error against alpha (calibration: conf_k beside alpha_k). The statistics are teacher forced: a slot's
Markov input is the data's token, which is the drafted one when the chain got that far and the data is the target's
greedy answer.

`init=<folder>`: a trained DFlash head folder warm-starts the backbone (every DFlash tensor, its vocab map, block size
and mask token); the Markov and confidence heads start from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..core import DraftsmithError, checks
from ..core.method_hooks import TrainingHooks
from ..heads.block import block_mask
from ..heads.block_folders import DFLASH_ARCHITECTURE, read_dflash_folder
from ..heads.dspark import DEFAULT_MARKOV_RANK, DSparkHead, dspark_config_from_target
from ..heads.folders import EMBED, read_config_json
from .block import block_forward, block_prepare, counted_slots, slot_stats
from .features import TargetSide, vocab_map_for
from .stats import CHAIN_STATS, STEP_STATS, summarize_steps

# the confidence's sums per block position: its BCE, its mean, its absolute error against alpha (over metric_count)
CONFIDENCE_STATS = ("confidence_bce_sum", "confidence_sum", "confidence_error_sum")
STATS = STEP_STATS + CHAIN_STATS + CONFIDENCE_STATS
OFFLINE_DATA = "hidden_states"  # what mode=offline reads from a data-gen folder: the target's features (its 3 layers)
CE_TARGETS = ("token", "soft")


@dataclass
class DSparkConfig:
    """`method=dspark`: the options of DSpark training (configs/method/dspark.yaml)."""

    name: str = "dspark"  # the method (set by method=dspark)
    draft_vocab_size: int = 32000  # the most frequent assistant tokens; capped at the target's vocab
    num_layers: int = 4  # decoder layers of the drafter
    block_size: int = 8  # B: a block is the anchor and B-1 mask slots; eval drafts up to B-1 tokens
    max_anchors: int = 64  # blocks per sequence per step
    mask_token_id: Optional[int] = None  # token id of the mask slots; None = the target's last vocab id
    markov_rank: int = DEFAULT_MARKOV_RANK  # r of the Markov head W2 · W1[previous token]
    ce_weight: float = 0.1  # DeepSpec's loss weights
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    slot_decay: float = 4.0  # the drafted slot j = 0, 1, .. (block position j+1) weighs exp(-j / slot_decay)
    ce: str = "token"  # token: CE on the data's next token (DeepSpec's) | soft: draftsmith's soft CE on the target's p
    init: Optional[str] = None  # a trained DFlash head folder whose backbone starts this drafter (None: the target's)

    def __post_init__(self):
        checks.one_of("method.name", self.name, ("dspark",))
        checks.at_least("method.draft_vocab_size", self.draft_vocab_size, 1)
        checks.at_least("method.num_layers", self.num_layers, 1)
        checks.at_least("method.block_size", self.block_size, 2)
        checks.at_least("method.max_anchors", self.max_anchors, 1)
        checks.at_least("method.markov_rank", self.markov_rank, 1)
        for name in ("ce_weight", "l1_weight", "confidence_weight"):
            checks.at_least(f"method.{name}", getattr(self, name), 0)
        checks.positive("method.slot_decay", self.slot_decay)
        checks.one_of("method.ce", self.ce, CE_TARGETS)
        if self.mask_token_id is not None:
            checks.at_least("method.mask_token_id", self.mask_token_id, 0)


# ---- the loss -----------------------------------------------------------------------------------------------

def dspark_terms(q_logits: torch.Tensor, conf_logits: torch.Tensor, p: torch.Tensor, in_mass: torch.Tensor,
                 label: torch.Tensor, has_label: torch.Tensor, weight: torch.Tensor, cfg: DSparkConfig,
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(L, per-slot terms {ce, l1, bce, alpha} (M,)) of M slots (module docstring): q_logits (M, Vd) with the Markov
    bias, conf_logits (M,), p (M, Vd) the target's renormalised distribution over the draft vocab, in_mass (M,) its
    mass there, label (M,) the draft id of the data's next token (ce=token) where has_label (M,) bool, weight (M,)
    w_k (0 for a slot outside the loss). Runs in the inputs' dtype."""
    logq = torch.log_softmax(q_logits, dim=-1)  # (M, Vd)
    l1 = (logq.exp() - p * in_mass[:, None]).abs().sum(-1) + (1 - in_mass)  # (M,) over the target vocab
    alpha = (1 - l1 / 2).clamp(0, 1)  # 1 - TV: the acceptance probability
    if cfg.ce == "soft":
        ce, ce_weight = -(p * logq).sum(-1), weight
    else:
        ce = -logq.gather(-1, label.clamp(min=0)[:, None]).squeeze(-1)  # a slot without a label has weight 0
        ce_weight = weight * has_label
    bce = F.binary_cross_entropy_with_logits(conf_logits, alpha.detach().to(conf_logits.dtype), reduction="none")
    tiny = torch.finfo(weight.dtype).tiny  # an empty micro-batch: 0 / tiny = 0
    loss = (cfg.ce_weight * (ce * ce_weight).sum() / ce_weight.sum().clamp(min=tiny)
            + cfg.l1_weight * (l1 * weight).sum() / weight.sum().clamp(min=tiny)
            + cfg.confidence_weight * (bce * weight).sum() / weight.sum().clamp(min=tiny))
    return loss, {"ce": ce * (ce_weight > 0), "l1": l1, "bce": bce, "alpha": alpha}


def dspark_loss(head: DSparkHead, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                aux: torch.Tensor, target: TargetSide, anchor: torch.Tensor, real: torch.Tensor, cfg: DSparkConfig,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of one micro-batch and its statistics (block_size-1, len(STATS)) for logging."""
    B, T = input_ids.shape
    bs = head.block_size
    mask = block_mask(anchor, bs, attention_mask)
    h = block_forward(head, input_ids, aux, anchor, mask).view(B, -1, bs, head.config.hidden_size)  # (B, n, bs, H)
    counted, u = counted_slots(anchor, real, loss_mask.bool() & attention_mask.bool(), bs)
    b_i, j_i, k_i = torch.nonzero(counted, as_tuple=True)  # (M,) the counted slots only: logits of no others
    t_i = u[b_i, j_i, k_i]
    q_logits, conf_logits = head.slot_outputs(h[b_i, j_i, k_i], input_ids[b_i, t_i])  # teacher forced: x_u
    q_logits, conf_logits = q_logits.float(), conf_logits.float()  # (M, Vd), (M,)
    in_loss = target.argmax_in_draft[b_i, t_i]  # (M,)
    nxt = (t_i + 1).clamp(max=T - 1)  # the position of the data's next token x_{a+k}
    y = input_ids[b_i, nxt]  # (M,) target ids
    has_label = (t_i + 1 <= T - 1) & attention_mask[b_i, nxt].bool() & head.t2d[y]
    label = torch.cumsum(head.t2d.long(), 0)[y] - 1  # draft id of y: draft ids follow the target ids' order
    weight = torch.exp(-(k_i - 1).to(q_logits.dtype) / cfg.slot_decay) * in_loss  # (M,) w_k
    p, in_mass = target.probs[b_i, t_i].to(q_logits.dtype), target.in_mass[b_i, t_i].to(q_logits.dtype)
    loss, terms = dspark_terms(q_logits, conf_logits, p, in_mass, label, has_label, weight, cfg)
    with torch.no_grad():
        slot_loss = (cfg.ce_weight * terms["ce"] + cfg.l1_weight * terms["l1"]
                     + cfg.confidence_weight * terms["bce"]) * in_loss
        correct = head.draft_to_target(q_logits.argmax(dim=-1)) == target.argmax[b_i, t_i]
        stats = slot_stats(counted, (b_i, j_i, k_i), slot_loss, in_loss, correct, terms["alpha"])
        conf = torch.sigmoid(conf_logits)
        one_hot = F.one_hot(k_i - 1, bs - 1).to(conf.dtype)  # (M, bs-1): row k-1 = block position k
        extra = torch.stack([one_hot.T @ terms["bce"], one_hot.T @ conf, one_hot.T @ (conf - terms["alpha"]).abs()], 1)
    return loss, torch.cat([stats, extra], dim=1)  # stats columns: STATS, one row per block position 1 .. bs-1


def summarize(stats: torch.Tensor) -> dict:
    """DFlash's metrics and E[tau] (train/stats.py), plus per block position i: confidence_bce_i, confidence_i (the
    mean predicted acceptance, beside alpha_i: calibration) and confidence_error_i (mean |confidence - alpha|)."""
    out = summarize_steps(stats, STATS)
    s = stats.double()
    for i in range(s.shape[0]):
        row = dict(zip(STATS, s[i].tolist()))
        n = max(row["metric_count"], 1)
        out[f"confidence_bce_{i}"] = row["confidence_bce_sum"] / n
        out[f"confidence_{i}"] = row["confidence_sum"] / n
        out[f"confidence_error_{i}"] = row["confidence_error_sum"] / n
    return out


class DSparkStep(nn.Module):
    """The trainable module the trainer wraps: the drafter plus its loss (the target stays outside).

    forward(batch) -> (loss, stats); `prepare` adds aux, the TargetSide and the sampled anchors."""

    def __init__(self, drafter: DSparkHead, cfg: DSparkConfig):
        super().__init__()
        self.drafter, self.cfg = drafter, cfg

    def forward(self, input_ids, attention_mask, loss_mask, aux, target: TargetSide, anchor, real):
        return dspark_loss(self.drafter, input_ids, attention_mask, loss_mask, aux, target, anchor, real, self.cfg)


# ---- the method table's entry points (draftsmith.core.methods) ----------------------------------------

def warm_start(target, cfg: DSparkConfig) -> DSparkHead:
    """A drafter whose backbone is the DFlash head folder `cfg.init` (every tensor checked; embed_tokens the target's
    when the folder has none), its shape the folder's; the Markov and confidence heads new. Refused in one sentence
    when the folder is another method's, was made for another target, or its shape differs from the options."""
    assert cfg.init is not None  # (new_dspark's condition)
    folder = Path(cfg.init)
    raw = read_config_json(folder) if folder.is_dir() else {}
    if DFLASH_ARCHITECTURE not in (raw.get("architectures") or []):
        raise DraftsmithError(f"method.init={folder} is not a DFlash head folder (its config.json declares "
                              f"architectures {raw.get('architectures')!r}); DSpark starts from the folder "
                              f"`draftsmith train method=dflash` writes ({DFLASH_ARCHITECTURE}).")
    c, tensors = read_dflash_folder(folder)
    shape = [("num_layers", cfg.num_layers, c.num_hidden_layers), ("block_size", cfg.block_size, c.block_size),
             ("draft_vocab_size", min(cfg.draft_vocab_size, target.vocab_size), c.draft_vocab_size)]
    if cfg.mask_token_id is not None:  # None: the folder's
        shape.append(("mask_token_id", cfg.mask_token_id, c.mask_token_id))
    for key, want, have in shape:
        if want != have:
            raise DraftsmithError(f"method.init={folder} has {key} {have}, but method.{key}={want}: set "
                                  f"method.{key}={have} to start from it.")
    if (c.target_hidden_size, list(c.aux_layer_ids)) != (target.hidden_size, list(target.aux_layer_ids)):
        raise DraftsmithError(f"method.init={folder} reads target layers {list(c.aux_layer_ids)} of hidden size "
                              f"{c.target_hidden_size}, but the target computes {list(target.aux_layer_ids)} of "
                              f"{target.hidden_size}: it was made for another target.")
    tensors.setdefault(EMBED, target.model.get_input_embeddings().weight.detach())
    head = DSparkHead(dspark_config_from_target(target.model.config, c.draft_vocab_size, c.num_hidden_layers,
                                                c.block_size, c.mask_token_id, c.aux_layer_ids, cfg.markov_rank))
    missing, unexpected = head.load_state_dict(tensors, strict=False)  # copied into the head's float32
    assert not unexpected and all(k.startswith(("markov_head.", "confidence_head.")) for k in missing), missing
    return head


def new_dspark(target, cfg: DSparkConfig, train, resume: Optional[Path]) -> DSparkHead:
    """A drafter for `target`: warm-started from `method.init` when set, else as DFlash builds one (the vocab map
    from the data or, on resume, the checkpoint; embeddings and lm_head rows copied from the target) with new
    Markov and confidence heads."""
    if cfg.init:
        return warm_start(target, cfg)  # on resume the checkpoint's weights then replace every tensor
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else target.vocab_size - 1
    if mask_id >= target.vocab_size:
        raise DraftsmithError(f"method.mask_token_id={mask_id} is outside the target's vocab "
                              f"(0..{target.vocab_size - 1}).")
    if len(target.aux_layer_ids) != 3:
        raise DraftsmithError(f"target.aux_layer_ids={target.aux_layer_ids} names {len(target.aux_layer_ids)} "
                              f"layers; the DSpark drafter reads 3.")
    d2t, t2d = vocab_map_for(target, cfg.draft_vocab_size, train, resume)
    head = DSparkHead(dspark_config_from_target(target.model.config, d2t.numel(), cfg.num_layers, cfg.block_size,
                                                mask_id, target.aux_layer_ids, cfg.markov_rank))
    head.init_from_target(target.model, d2t, t2d)
    return head


def dspark_training(head: DSparkHead, target, cfg: DSparkConfig, mode: str,
                    autocast: Callable) -> tuple[DSparkStep, Callable[[dict], dict]]:
    """(the module to train, `prepare(batch)`): DFlash's prepare (the target side under no_grad, the anchors drawn
    with torch's CPU generator, restored on resume)."""
    return DSparkStep(head, cfg), block_prepare(head.t2d, target, mode, autocast, cfg.max_anchors)


# the method table's hooks (draftsmith.core.method_hooks); summarize (above): metrics, E[tau] and the confidence's
# calibration from the summed statistics
HOOKS = TrainingHooks(config=DSparkConfig, offline_data=OFFLINE_DATA, new_drafter=new_dspark, training=dspark_training,
                      summarize=summarize)
