"""The one trainer: distributed setup, wrapping a built module for training, the loop, checkpoints.

    resolve_deepspeed -> (name, why)     deepspeed=auto: none for one process (or optimizer=muon), zero2 for several
    resolve_precision -> (name, why)     precision=auto: bf16 where this machine computes bf16 fast, else fp32
    init_distributed  -> (rank, world)   torchrun / deepspeed launchers, or a single process
    wrap_for_training -> Wrapped         DeepSpeed ZeRO 1/2/3 engine, or plain torch (DDP when world > 1), with the
                                         optimizer=adamw | muon (train/optimizers.py)
    train_loop        -> dict            LR -> micro-steps -> clip + step -> log -> checkpoint

The method's step (its entry in draftsmith.core.methods; EAGLE-3's is train/eagle3.py) is a module
`forward(**batch) -> (loss, stats)` whose `drafter` submodule is what checkpoints and the final
folder hold; the frozen target never enters it: `prepare(batch)` computes the target side under
no_grad before forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Mapping, Optional, Protocol, cast

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from ..core import DraftsmithError, distributed, machine
from ..core.locks import stale_extension_locks
from ..core.procenv import launched_processes
from ..core.progress import progress
from . import checkpoint as ckpt
from .config import TrainConfig
from .data import TrainData, collate, micro_batch_plan, prefetch
from .optimizers import build_optimizer

log = logging.getLogger(__name__)

DS_CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "deepspeed"


@dataclass
class TrainerConfig:
    """What the trainer reads: the loop, optimisation and logging options of `draftsmith train`.

    Built from the stage's TrainConfig by `from_train` (the defaults and checks live there)."""

    device: str
    seed: int
    precision: str  # fp32 | bf16 | fp16 (auto resolved by resolve_precision)
    deepspeed: str  # none | zero1 | zero2 | zero3 | a DeepSpeed JSON (auto resolved by resolve_deepspeed)
    micro_batch_size: int
    grad_accum: int
    mega_batch: int
    lr: float
    min_lr_ratio: float
    warmup_ratio: float
    weight_decay: float
    betas: tuple[float, float]
    optimizer: str  # adamw | muon (train/optimizers.py)
    muon_lr: Optional[float]
    muon_momentum: float
    muon_weight_decay: float
    grad_clip: float
    save_every: int
    keep_last: int
    log_every: int
    eval_every: int
    select_by: str
    progress: bool
    wandb: object  # mode, project, name

    @staticmethod
    def from_train(cfg) -> "TrainerConfig":
        values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainerConfig) if f.name != "deepspeed"}
        values["betas"] = tuple(values["betas"])
        return TrainerConfig(deepspeed=cfg.deepspeed.config, **values)


def resolve_deepspeed(requested: str, environ: Optional[Mapping[str, str]] = None,
                      optimizer: str = TrainConfig.optimizer) -> tuple[str, str]:
    """(deepspeed preset or JSON, why). auto: none (plain torch, as deepspeed=none) for one process, so that
    nothing of DeepSpeed is imported and none of its ops is JIT-built (on CPU it compiles them with g++ on
    first use); zero2 when launched with several processes (procenv.launched_processes of `environ`), unless
    optimizer=muon, which ZeRO cannot hold (train/optimizers.py): then none, DDP over the processes."""
    if requested != "auto":
        return requested, "as requested"
    processes, source = launched_processes(environ)
    if optimizer == "muon":
        return "none", (f"optimizer=muon: plain torch (DDP over {processes} processes), as ZeRO cannot hold Muon's "
                        f"whole weight matrices" if processes > 1 else "one process: plain torch, no DeepSpeed")
    if processes > 1:
        return "zero2", f"{processes} processes ({source}={processes}): DeepSpeed ZeRO-2"
    return "none", "one process: plain torch, no DeepSpeed"


PRECISION_DTYPES = {"auto": "auto", "fp32": "float32", "bf16": "bfloat16"}


def resolve_precision(requested: str, device: str) -> tuple[str, str]:
    """(fp32 | bf16 | fp16, why). auto: bf16 where draftsmith.core.machine finds bf16 fast on `device`, else fp32;
    an explicit bf16 where it is slow still trains (draftsmith.core.machine warns once)."""
    if requested == "fp16":
        return "fp16", "as requested"
    dtype, why = machine.resolve_dtype(PRECISION_DTYPES[requested], device)
    return ("bf16" if dtype == torch.bfloat16 else "fp32"), why


def init_distributed(cfg) -> tuple[int, int]:
    """(rank, world_size). Launched by torchrun / deepspeed (env vars set) or as one plain process; every path that
    makes a group (draftsmith.core.distributed) takes this process's GPU first."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.deepspeed == "none" and world == 1:
        return 0, 1
    stale = stale_extension_locks() if cfg.deepspeed != "none" else []
    if stale:
        raise DraftsmithError(f"{stale[0]} is left by a killed DeepSpeed op build (no process holds it) and "
                              f"DeepSpeed would wait on it forever; delete it and rerun.")
    if world == 1:  # DeepSpeed needs a process group even alone: init_group makes a private one
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)  # DeepSpeed reads these
    distributed.init_group(cfg.device, world)
    if cfg.deepspeed != "none":
        import deepspeed

        deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the group
    return dist.get_rank(), dist.get_world_size()


def cosine_lambda(warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine down to min_ratio at `total` steps."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def deepspeed_config(cfg, world: int) -> dict:
    """configs/deepspeed/<name>.json (or a path) completed with this run's batch, clipping and precision."""
    path = Path(cfg.deepspeed) if cfg.deepspeed.endswith(".json") else DS_CONFIGS / f"{cfg.deepspeed}.json"
    if not path.is_file():
        names = sorted(p.stem for p in DS_CONFIGS.glob("*.json"))
        raise DraftsmithError(f"deepspeed={cfg.deepspeed!r} is not none, one of {names} (deepspeed=...), nor a JSON file (deepspeed.config=...).")
    conf = json.loads(path.read_text())
    conf.update(train_micro_batch_size_per_gpu=cfg.micro_batch_size, gradient_accumulation_steps=cfg.grad_accum,
                train_batch_size=cfg.micro_batch_size * cfg.grad_accum * world, gradient_clipping=cfg.grad_clip)
    if cfg.precision == "fp16":
        conf["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return conf


class DeepSpeedEngine(Protocol):
    """What the trainer calls on DeepSpeed's engine (deepspeed carries no type information)."""

    def backward(self, loss: torch.Tensor) -> object: ...

    def step(self) -> None: ...

    def zero_optimization_stage(self) -> int: ...

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> object: ...

    def load_checkpoint(self, load_dir: str, tag: str, load_optimizer_states: bool,
                        load_lr_scheduler_states: bool) -> object: ...


@dataclass
class Wrapped:
    """A module ready to train: forward / backward / step look the same for DeepSpeed and plain torch."""

    module: nn.Module  # the raw method module (weights, state_dict)
    model: nn.Module  # what forward is called on: DeepSpeed engine, DDP or the module itself
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    engine: Optional[DeepSpeedEngine]  # the DeepSpeed engine, or None
    grad_accum: int
    grad_clip: float
    _micro: int = 0

    def no_sync(self):
        """Around a micro-batch's forward and backward: DDP all-reduces gradients in backward, which only the
        step's last micro-batch needs (DeepSpeed decides this itself; one process has nothing to reduce)."""
        last = (self._micro + 1) % self.grad_accum == 0
        if self.engine is None and self.model is not self.module and not last:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.backward(loss)  # scales by 1 / grad_accum itself
        else:
            (loss / self.grad_accum).backward()

    def micro_step(self) -> None:
        """Call after every micro-batch; the optimizer steps every grad_accum of them."""
        if self.engine is not None:
            self.engine.step()
            return
        self._micro += 1
        if self._micro % self.grad_accum == 0:
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def full_weights(self):
        """Yield the drafter's full state dict (ZeRO-3 gathers the partitions on every rank)."""
        if self.engine is not None and self.engine.zero_optimization_stage() == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
                yield {k: v.detach().clone() for k, v in self.module.drafter.state_dict().items()}
        else:
            yield self.module.drafter.state_dict()


def wrap_for_training(module: nn.Module, cfg, world: int, total_steps: int) -> Wrapped:
    """The one function that turns a built module into something trainable (DeepSpeed or plain torch)."""
    optimizer = build_optimizer(module, cfg)
    warmup = max(1, int(cfg.warmup_ratio * total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_lambda(warmup, total_steps, cfg.min_lr_ratio))
    if cfg.deepspeed == "none":
        model = module
        if world > 1:
            model = nn.parallel.DistributedDataParallel(module)
        return Wrapped(module, model, optimizer, scheduler, None, cfg.grad_accum, cfg.grad_clip)
    # bf16 is autocast around forward: DeepSpeed keeps fp32 weights and optimizer state.
    import deepspeed

    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=module, model_parameters=[p for p in module.parameters() if p.requires_grad], optimizer=optimizer,
        lr_scheduler=scheduler,
        config=deepspeed_config(cfg, world))
    return Wrapped(module, engine, optimizer, scheduler, engine, cfg.grad_accum, cfg.grad_clip)


def autocast(cfg):
    """bf16 mixed precision by autocast (fp32 master weights); a nullcontext otherwise."""
    if cfg.precision == "bf16":
        return torch.autocast(device_type=torch.device(cfg.device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def save_checkpoint(w: Wrapped, out: Path, step: int, state: dict, rank: int, world: int, keep_last: int) -> None:
    """All ranks: write the temp folder; rank 0 publishes it once everyone is done."""
    tmp = ckpt.tmp_path(out, step)
    if rank == 0:
        tmp.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    if w.engine is not None:
        w.engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", save_latest=False)
    elif rank == 0:
        ckpt.save_optimizer(w.optimizer, tmp)
    ckpt.write_rng(tmp, rank)
    with w.full_weights() as sd:
        if rank == 0:
            ckpt.write_common(tmp, sd, state, w.scheduler.state_dict())
    distributed.barrier()
    if rank == 0:
        ckpt.publish(out, step, keep_last)
    distributed.barrier()


def load_checkpoint(w: Wrapped, path: Path, rank: int) -> None:
    """Restore weights, optimizer, scheduler and this rank's RNG from a checkpoint.

    DeepSpeed's pickles are first proven loadable with weights_only=True (checkpoint.py), and
    DeepSpeed's own load runs under the same restriction: nothing in a checkpoint is executed."""
    if w.engine is not None:
        ckpt.verify_deepspeed_files(path)
        with ckpt.restricted_deepspeed_load(w.engine):
            w.engine.load_checkpoint(str(path / "deepspeed"), tag="state", load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    else:
        w.module.get_submodule("drafter").load_state_dict(load_file(str(path / "head.safetensors")), strict=True)
        ckpt.load_optimizer(w.optimizer, path)
    w.scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
    ckpt.read_rng(path, rank)


WandbMode = Literal["online", "offline", "disabled", "shared"]  # wandb.init's modes


def wandb_mode(mode: str) -> str:
    """auto = the environment's WANDB_MODE when set, else online with WANDB_API_KEY, else offline."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class Logger:
    """metrics.jsonl + wandb + a progress bar (draftsmith.core.progress), on rank 0 only.

    A fresh run (start == 0) starts metrics.jsonl clean; a resumed one appends (run.py has already
    dropped the records past the checkpoint). If wandb cannot start (no network, bad key), one
    warning line goes to stderr and training continues with metrics.jsonl only."""

    def __init__(self, cfg, out: Path, rank: int, total: int, start: int, config_dict: dict):
        self.rank, self.path, self.bar, self.run = rank, out / "metrics.jsonl", None, None
        if rank != 0:
            return
        if start == 0:
            self.path.write_text("")  # a killed earlier attempt must not leave its records in front of ours
        if cfg.progress:
            self.bar = progress(total=total, initial=start, desc="train", unit="step")
        mode = wandb_mode(cfg.wandb.mode)
        if mode != "disabled":
            try:
                import wandb

                # wandb checks the mode itself (a bad one: the warning below)
                self.run = wandb.init(project=cfg.wandb.project, name=cfg.wandb.name, mode=cast(WandbMode, mode),
                                      dir=str(out), config=config_dict, resume="allow")
            except Exception as e:  # noqa: BLE001 - deliberate, loudly reported fallback
                first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
                log.warning(f"draftsmith train: warning: wandb (mode={mode}) did not start ({type(e).__name__}: "
                            f"{first[:200]}); training continues without wandb, metrics go to {self.path} only.")
                self.run = None

    def log(self, record: dict) -> None:
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.run is not None:
            self.run.log(record, step=record["step"])
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss={record['loss']:.3f}, acc0={record.get('acc_0', 0):.3f}")
            self.bar.update(record["step"] - self.bar.n)  # log_every may skip steps

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            self.run.finish()


def evaluate(w: Wrapped, data: TrainData, prepare: Callable, summarize: Callable, cfg, world: int) -> dict:
    """Per-step metrics over a held-out split (every rank evaluates it all: it is small)."""
    w.module.eval()
    total = None
    with torch.no_grad():
        for start in range(0, len(data.indices), cfg.micro_batch_size):
            batch = prepare(collate(data, list(range(start, min(start + cfg.micro_batch_size, len(data.indices)))),
                                    cfg.device))
            with autocast(cfg):
                _, stats = w.module(**batch)
            total = stats if total is None else total + stats
    w.module.train()
    assert total is not None, "no held-out rows to evaluate"
    return {f"val_{k}": v for k, v in summarize(total.cpu()).items()}  # one host read: summarize reads it row by row


def selection_key(cfg, metrics: dict) -> str:
    """The held-out metric (a key of `metrics`, val_ prefixed) that picks out/best/; higher is better."""
    name = cfg.select_by
    if name == "auto":
        name = "etau_greedy" if "val_etau_greedy" in metrics else "acc_0"
    if f"val_{name}" not in metrics:
        shown = sorted(k[len("val_"):] for k in metrics)
        raise DraftsmithError(f"select_by={cfg.select_by!r}: this method's held-out metrics have no {name!r}; "
                              f"choose one of {shown}.")
    return f"val_{name}"


def train_loop(w: Wrapped, cfg, data: TrainData, prepare: Callable, summarize: Callable, out: Path,
               rank: int, world: int, total_steps: int, start_step: int, state_extra: dict,
               logger: Logger, val: Optional[TrainData] = None, best: Optional[dict] = None,
               save_best: Optional[Callable[[], None]] = None) -> tuple[dict, dict]:
    """Run optimizer steps start_step..total_steps; returns (the last logged record, the last held-out metrics).

    With `val` and cfg.eval_every > 0 the held-out rows are evaluated every eval_every steps and at the end
    (before that step's checkpoint, so its state includes the evaluation); when the selection metric beats
    `best` (the resumable best-so-far: step, metric, score), `save_best()` writes out/best/ and `best` is updated."""
    global_batch = cfg.micro_batch_size * cfg.grad_accum * world
    batches_per_epoch = len(data.indices) // global_batch
    lengths = data.lengths()
    record: dict = {}
    val_metrics: dict = {}
    best = best if best is not None else {}
    step = start_step
    w.module.train()
    # This rank's micro-batches in the loop's order (a pure function of seed, epoch and step: exact resume), read
    # ahead by a thread (the offline shards' rows, pinned on CUDA) while the device computes.
    stream = prefetch(data, micro_batch_plan(lengths, global_batch, cfg.mega_batch, cfg.seed, cfg.micro_batch_size,
                                             rank, world, start_step, total_steps), cfg.device)
    try:
        while step < total_steps:
            epoch = step // batches_per_epoch
            t0 = time.perf_counter()
            # The step's record (loss, tokens, stats) stays on the device until its one host read, after the reduce.
            stats_sum, loss_sum, tokens = None, torch.zeros((), device=cfg.device), torch.zeros((), device=cfg.device)
            for _ in range(cfg.grad_accum):
                batch = prepare(next(stream))
                with w.no_sync():
                    with autocast(cfg):
                        loss, stats = w.model(**batch)
                    w.backward(loss)
                w.micro_step()
                loss_sum += loss.detach().float()
                tokens += batch["attention_mask"].sum()
                stats_sum = stats if stats_sum is None else stats_sum + stats
            assert stats_sum is not None  # grad_accum >= 1 micro-batches
            step += 1
            reduced = distributed.all_reduce(torch.cat([loss_sum[None], tokens[None], stats_sum.flatten()]))
            values = reduced.tolist()  # the step's one host sync
            dt = time.perf_counter() - t0
            record = {"step": step, "epoch": epoch, "loss": values[0] / (cfg.grad_accum * world),
                      "lr": w.scheduler.get_last_lr()[0], "tokens": int(values[1]),
                      "step_s": round(dt, 4), "tokens_per_s": round(values[1] / dt, 1),
                      **summarize(torch.tensor(values[2:], dtype=reduced.dtype).view(stats_sum.shape))}
            evaluated = val is not None and cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == total_steps)
            if evaluated and val is not None:
                val_metrics = evaluate(w, val, prepare, summarize, cfg, world)
                key = selection_key(cfg, val_metrics)
                record.update(val_metrics)
                if not best or val_metrics[key] > best["score"]:
                    if save_best is not None:
                        save_best()
                    best.clear()
                    best.update(step=step, metric=key, score=val_metrics[key])
                record["best_step"] = best["step"]
            if step % cfg.log_every == 0 or step == total_steps or evaluated:
                logger.log(record)
            if step % cfg.save_every == 0 or step == total_steps:
                state = {**state_extra, "step": step, "epoch": step // batches_per_epoch,
                         "batch_in_epoch": step % batches_per_epoch, "metrics": record, "best": dict(best)}
                save_checkpoint(w, out, step, state, rank, world, cfg.keep_last)
    finally:
        stream.close()
    return record, val_metrics
