"""Config of the training stage (registered with Hydra in draftsmith.configs as `train_schema`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from omegaconf import MISSING

from ..core import DraftsmithError, checks
from ..data_gen.target import TargetConfig
from ..core.procenv import launched_processes

DEEPSPEED_PRESETS = ("auto", "none", "zero1", "zero2", "zero3")
PACKING_METHODS = ("eagle3",)  # the methods whose step reads packed rows (position_ids, document_ids)


@dataclass
class WandbConfig:
    # auto = WANDB_MODE if set, else "online" with WANDB_API_KEY, else "offline"; "disabled" for tests.
    # A wandb that fails to start is reported in one warning line; training goes on without it.
    mode: str = "auto"
    project: str = "draftsmith"  # the wandb project
    name: Optional[str] = None  # the wandb run name (None = wandb's own)

    def __post_init__(self):
        checks.one_of("wandb.mode", self.mode, ("auto", "online", "offline", "disabled"))


@dataclass
class DeepSpeedConfig:
    # auto (none for one process, zero2 when launched with several: train/trainer.py resolve_deepspeed) |
    # zero1 | zero2 | zero3 (configs/deepspeed/<name>.json) | a path to a DeepSpeed JSON | none (plain torch; DDP
    # when launched with several processes)
    config: str = "auto"

    def __post_init__(self):
        if not str(self.config).endswith(".json"):
            checks.one_of("deepspeed.config", self.config, DEEPSPEED_PRESETS)


@dataclass
class TrainConfig:
    # The drafting method and its options: method=<name> picks configs/method/<name>.yaml, typed by the method's
    # options dataclass (train/<name>.py's HOOKS.config, its row in draftsmith.core.methods;
    # method.draft_vocab_size=8192, ...). No method is the default here: `draftsmith train` takes configs/train.yaml's
    # default, code passes one (method=Eagle3Config(), ...).
    method: Any = MISSING
    CHOSEN_BY_GROUP: ClassVar[tuple[str, ...]] = ("method",)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: str = "???"  # a data-gen output folder
    out: str = "runs/train"  # output folder: final/, checkpoints/, metrics.jsonl
    overwrite: bool = False  # true: write into an out folder that is not an earlier train output
    # auto = offline when the data has hidden_states/, else online (target in the process)
    mode: str = "auto"
    device: str = "cpu"  # cpu | cuda (one device per process) | cuda:<index>
    seed: int = 0  # initialisation and data order

    # data
    max_length: int = 2048  # tokens per sample (longer samples are cut)
    micro_batch_size: int = 1  # per process
    grad_accum: int = 1  # micro-batches per optimizer step
    mega_batch: int = 64  # length bucketing: sort by length within this many global batches
    # 0 = off (each conversation its own right-padded row) | N: a micro-batch's conversations are packed first-fit, in
    # order, into rows of at most N tokens (positions restart and attention stays inside each conversation);
    # method=eagle3 only; at least max_length, so every conversation (cut at max_length) fits a row
    pack_tokens: int = 0
    val_samples: int = 0  # hold out the last N samples; evaluated at the end (and every eval_every steps)
    train_samples: Optional[int] = None  # train on only the first N samples left after val_samples (None = all)
    # optimizer steps between held-out evaluations (needs val_samples); the best head so far by select_by is
    # kept in out/best/ (same format as out/final/). 0 = evaluate only at the end, no out/best/
    eval_every: int = 0
    # held-out metric that picks out/best/ (higher is better): etau_greedy | etau_sample (EAGLE-3's expected
    # acceptance length over its TTT depth) | acc_0 | alpha_0 | auto (etau_greedy when logged, else acc_0)
    select_by: str = "auto"

    # optimisation
    epochs: int = 1  # passes over the data (when max_steps is None)
    max_steps: Optional[int] = None  # optimizer steps; None = epochs over the data
    lr: float = 1e-4  # peak learning rate (AdamW)
    min_lr_ratio: float = 0.0  # cosine decay ends at lr * min_lr_ratio
    warmup_ratio: float = 0.02  # share of the steps with linear warm-up
    weight_decay: float = 0.0  # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas
    # adamw | muon (torch's Muon over the 2-D weight matrices, AdamW over norms and lm_head: train/optimizers.py;
    # plain torch only, deepspeed=none)
    optimizer: str = "adamw"
    muon_lr: Optional[float] = None  # Muon's peak learning rate (its update RMS matched to AdamW's); null = lr
    muon_momentum: float = 0.95  # Muon's momentum (Nesterov)
    muon_weight_decay: float = 0.1  # Muon's decoupled weight decay
    grad_clip: float = 0.5  # max gradient norm; 0 = off
    # auto (bf16 where this machine computes bf16 fast, else fp32: draftsmith.core.machine) | fp32 | bf16 (autocast, fp32
    # master weights) | fp16 (DeepSpeed loss scaling)
    precision: str = "auto"
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # config group: deepspeed=auto|none|zero1|zero2|zero3

    # checkpoints and logging
    save_every: int = 500  # optimizer steps between checkpoints
    keep_last: int = 2  # checkpoints kept under out/checkpoints
    resume: Optional[str] = None  # true = latest checkpoint under out/, or a checkpoint folder
    log_every: int = 1  # optimizer steps between metrics.jsonl lines
    progress: bool = True  # show a progress bar
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self):
        if self.data in (None, ""):
            raise DraftsmithError("data= is required: a data-gen output folder.")
        checks.one_of("mode", self.mode, ("auto", "online", "offline"))
        checks.device("device", self.device)
        for name in ("max_length", "micro_batch_size", "grad_accum", "mega_batch", "epochs", "save_every",
                     "keep_last", "log_every"):
            checks.at_least(name, getattr(self, name), 1)
        checks.at_least("val_samples", self.val_samples, 0)
        checks.at_least("pack_tokens", self.pack_tokens, 0)
        method = getattr(self.method, "name", None)  # None while method= is still missing (refused by validate)
        if self.pack_tokens and method not in (None, *PACKING_METHODS):
            raise DraftsmithError(f"pack_tokens={self.pack_tokens} packs conversations for method=eagle3 only; "
                                  f"method={method}'s step reads one right-padded conversation per row: set pack_tokens=0.")
        if 0 < self.pack_tokens < self.max_length:
            raise DraftsmithError(f"pack_tokens={self.pack_tokens} is less than max_length={self.max_length}: a "
                                  f"conversation is cut at max_length and must fit one packed row; raise pack_tokens "
                                  f"or lower max_length.")
        checks.at_least("train_samples", self.train_samples, 1, null="all")
        checks.at_least("eval_every", self.eval_every, 0)
        checks.one_of("select_by", self.select_by, ("auto", "etau_greedy", "etau_sample", "acc_0", "alpha_0"))
        if self.eval_every > 0 and self.val_samples == 0:
            raise DraftsmithError(f"eval_every={self.eval_every} evaluates held-out rows; set val_samples to how many.")
        checks.at_least("max_steps", self.max_steps, 1, null="epochs over the data")
        checks.positive("lr", self.lr)
        checks.in_range("min_lr_ratio", self.min_lr_ratio, 0, 1)
        checks.in_range("warmup_ratio", self.warmup_ratio, 0, 1, high_open=True)
        checks.at_least("weight_decay", self.weight_decay, 0)
        if len(self.betas) != 2:
            raise DraftsmithError(f"betas={list(self.betas)} must be two numbers in [0, 1).")
        for beta in self.betas:
            checks.in_range("betas entry", beta, 0, 1, high_open=True)
        checks.one_of("optimizer", self.optimizer, ("adamw", "muon"))
        checks.positive("muon_lr", self.muon_lr, null="lr")
        checks.in_range("muon_momentum", self.muon_momentum, 0, 1, high_open=True)
        checks.at_least("muon_weight_decay", self.muon_weight_decay, 0)
        if self.optimizer == "muon" and self.deepspeed.config not in ("auto", "none"):
            raise DraftsmithError(f"optimizer=muon runs with plain torch (deepspeed=none, DDP with several processes), "
                                  f"not deepspeed={self.deepspeed.config}: ZeRO flattens and partitions the weight "
                                  f"matrices Muon orthogonalises whole.")
        if self.optimizer == "muon" and self.precision == "fp16":
            raise DraftsmithError("optimizer=muon runs without DeepSpeed, whose loss scaling precision=fp16 needs; use "
                                  "precision=bf16 or fp32.")
        checks.at_least("grad_clip", self.grad_clip, 0)
        checks.one_of("precision", self.precision, ("auto", "fp32", "bf16", "fp16"))
        if self.precision == "fp16" and self.deepspeed.config == "none":
            raise DraftsmithError("precision=fp16 needs DeepSpeed's loss scaling; use deepspeed=zero1/2/3 or precision=bf16.")
        if self.precision == "fp16" and self.deepspeed.config == "auto" and launched_processes()[0] == 1:
            raise DraftsmithError("precision=fp16 needs DeepSpeed's loss scaling, and deepspeed=auto is plain torch "
                                  "in one process; use deepspeed=zero1/2/3 or precision=bf16.")
