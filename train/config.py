"""Config of the training stage (registered with Hydra in draftsmith.configs as `train_schema`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from draftsmith.data_gen.target import TargetConfig


@dataclass
class WandbConfig:
    # auto = "online" when WANDB_API_KEY is set, else "offline"; "disabled" for tests.
    mode: str = "auto"
    project: str = "draftsmith"
    name: Optional[str] = None


@dataclass
class DeepSpeedConfig:
    # zero1 | zero2 | zero3 (configs/deepspeed/<name>.json), a path to a DeepSpeed JSON,
    # or none (plain torch; DDP when launched with several processes)
    config: str = "zero2"


@dataclass
class TrainConfig:
    method: str = "eagle3"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: str = "???"  # a data-gen output folder
    out: str = "runs/train"
    # auto = offline when the data has hidden_states/, else online (target in the process)
    mode: str = "auto"
    device: str = "cpu"
    seed: int = 0

    # EAGLE-3
    draft_vocab_size: int = 32000  # capped at the target's vocab
    ttt_steps: int = 7
    ttt_decay: float = 0.8

    # data
    max_length: int = 2048
    micro_batch_size: int = 1  # per process
    grad_accum: int = 1
    mega_batch: int = 64  # length bucketing: sort by length within this many global batches
    val_samples: int = 0  # hold out the last N samples; evaluated at the end

    # optimisation
    epochs: int = 1
    max_steps: Optional[int] = None  # optimizer steps; None = epochs over the data
    lr: float = 1e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.02
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    precision: str = "fp32"  # fp32 | bf16 (autocast, fp32 master weights) | fp16 (DeepSpeed loss scaling)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)  # config group: deepspeed=zero1|zero2|zero3|none

    # checkpoints and logging
    save_every: int = 500
    keep_last: int = 2
    resume: Optional[str] = None  # true = latest checkpoint under out/, or a checkpoint folder
    log_every: int = 1
    progress: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # tests only: raise after this optimizer step (simulates a crash)
    fail_at_step: Optional[int] = None
