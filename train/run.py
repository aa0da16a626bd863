"""`draftsmith train`: a data-gen folder -> a trained drafter in out/final (+ checkpoints, metrics).

    draftsmith train method=eagle3 target=smollm2 data=runs/smol out=runs/eagle3 method.draft_vocab_size=8192
    torchrun --nproc_per_node 2 -m draftsmith.cli train ... deepspeed=zero2

The method (`method=`, an entry of draftsmith.core.methods) builds the drafter, its training step and
its saved folder; this file is the same for every method.

Modes: online (the target runs in this process, features per batch under no_grad) and offline
(features read from the data's hidden_states/; the target is loaded once for its embeddings and
lm_head, then only the lm_head is kept to recompute target logits). auto = offline when the data
has hidden states.

run(cfg) returns {"out", "final", "mode", "steps", "metrics" (last step), "val" (held-out, if any)}.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from ..core import DraftsmithError, distributed, machine
from ..core.artifacts import (OWNER, atomic_write_bytes, atomic_write_json, claim_output, clean_temporaries,
                                  is_empty, owner_of, prepare_output, refuse_links, remove_written)
from ..data_gen.target import load_target, resolved_target
from ..core.methods import Method, method_for_config
from . import checkpoint as ckpt
from .config import TrainConfig
from .data import load_data
from .trainer import (Logger, TrainerConfig, autocast, evaluate, init_distributed,
                                      load_checkpoint, resolve_deepspeed, resolve_precision, train_loop,
                                      wrap_for_training)

log = logging.getLogger(__name__)


def compat_fields(cfg, identity: dict, world: int, n_train: int, total_steps: int) -> dict:
    """What a checkpoint must share with this run for exact resume (the method's options included).

    Every optimizer step reads the same global batch (micro_batch_size x grad_accum x world_size), cut into the
    same micro-batches, whatever the process count (batch_order depends on the global batch only), so the
    process count may change when the global batch stays. Not under ZeRO: its optimizer state is split per
    process and DeepSpeed refuses another data-parallel size, so there world_size must stay too."""
    method_options = {f"method.{k}": v for k, v in dataclasses.asdict(cfg.method).items()}
    fields = {"method": cfg.method.name, **method_options, "target_hash": identity["target_hash"],
              "tokenizer_hash": identity["tokenizer_hash"], "hidden_size": identity["hidden_size"],
              "deepspeed": cfg.deepspeed.config, "micro_batch_size": cfg.micro_batch_size,
              "global_batch": cfg.micro_batch_size * cfg.grad_accum * world, "train_samples": n_train,
              "total_steps": total_steps, "precision": cfg.precision, "seed": cfg.seed,
              "optimizer": cfg.optimizer}  # the optimizer state's layout (Muon's groups and buffers are not AdamW's)
    if cfg.deepspeed.config != "none":
        fields["world_size"] = world
    if cfg.eval_every > 0:  # the best-so-far in the checkpoint is by this metric, at these steps
        fields.update(eval_every=cfg.eval_every, select_by=cfg.select_by)
    if cfg.pack_tokens > 0:  # packing changes every micro-batch (0, off, is what checkpoints before it had)
        fields["pack_tokens"] = cfg.pack_tokens
    return fields


def resolve_auto(cfg: TrainConfig) -> tuple[TrainConfig, dict]:
    """The config with target.dtype, precision and deepspeed `auto` replaced by what this machine and launch call
    for (a new config: the saved config, the checkpoints' config and their compat then name what ran), and the
    record {option: {"requested", "value", "why"}} the checkpoints keep. Call once cfg.device is this process's."""
    target, dtype_why = resolved_target(cfg.target)
    precision, precision_why = resolve_precision(cfg.precision, cfg.device)
    deepspeed, deepspeed_why = resolve_deepspeed(cfg.deepspeed.config, optimizer=cfg.optimizer)
    if cfg.deepspeed.config == "auto":
        log.info(f"deepspeed auto -> {deepspeed}: {deepspeed_why}")
    resolved = dataclasses.replace(cfg, target=target, precision=precision,
                                   deepspeed=dataclasses.replace(cfg.deepspeed, config=deepspeed))
    record = {"target.dtype": (cfg.target.dtype, target.dtype, dtype_why),
              "precision": (cfg.precision, precision, precision_why),
              "deepspeed": (cfg.deepspeed.config, deepspeed, deepspeed_why)}
    return resolved, {k: {"requested": r, "value": v, "why": w} for k, (r, v, w) in record.items()}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---- the steps of a run, in order -----------------------------------------------------------------

def check_output(cfg) -> Path:
    """out= may be new, empty or train's own earlier output, and never holds what this run reads."""
    resume_path = ckpt.resume_path_given(cfg.resume)  # a checkpoint folder is read too
    out = prepare_output(cfg.out, "train", [("data", cfg.data), ("resume", resume_path), ("target", cfg.target.name)],
                         overwrite=bool(cfg.overwrite))
    refuse_links(out, ("checkpoints", "final", "best"))  # never written (nor removed) through
    best = out / "best"
    if cfg.eval_every > 0 and best.exists() and not (best.is_dir() and (is_empty(best) or owner_of(best) == "train_head")):
        raise DraftsmithError(f"{best} exists and is not a head draftsmith train wrote; train replaces out/best with "
                              f"the best held-out head (eval_every={cfg.eval_every}), so move it or choose another out.")
    return out


def total_steps_of(cfg, n_train: int, world: int) -> int:
    global_batch = cfg.micro_batch_size * cfg.grad_accum * world
    if n_train < global_batch:
        raise DraftsmithError(f"the data has {n_train} training samples, fewer than one global batch "
                              f"(micro_batch_size x grad_accum x world_size = {global_batch}).")
    return cfg.max_steps if cfg.max_steps is not None else cfg.epochs * (n_train // global_batch)


def find_resume(cfg, out: Path, compat: dict) -> tuple[Path | None, int]:
    """(checkpoint to resume from or None, its step); checked before anything is written."""
    resume = ckpt.resolve_resume(cfg.resume, out)
    if resume is None:
        if ckpt.list_checkpoints(out):
            raise DraftsmithError(f"out={str(out)!r} already holds training checkpoints; pass resume=true or choose another out.")
        return None, 0
    state = ckpt.read_state(resume)
    world = compat["global_batch"] // (cfg.micro_batch_size * cfg.grad_accum)
    ckpt.check_compatible(state, compat, resume, {"world_size": world, "grad_accum": cfg.grad_accum})
    return resume, state["step"]


def start_run_files(cfg, out: Path, resume: Path | None, start_step: int) -> None:
    """Rank 0: claim out/, save the config; a fresh run starts a new log, a resumed one drops the
    records past its checkpoint."""
    claim_output(out, "train")
    clean_temporaries(out, ("config.yaml", "metrics.jsonl", "val_metrics.json", OWNER))  # a killed run's leftovers
    if resume is None:
        (out / "metrics.jsonl").unlink(missing_ok=True)
        (out / "val_metrics.json").unlink(missing_ok=True)
        if (out / "best").is_dir() and owner_of(out / "best") == "train_head":  # an earlier run's best, never another's
            remove_written(out / "best")  # what draftsmith wrote there; a user's file stays
    atomic_write_bytes(out / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True).encode())
    if resume is not None and (out / "metrics.jsonl").is_file():
        lines = (out / "metrics.jsonl").read_text().splitlines()
        keep = [ln for ln in lines if json.loads(ln).get("step", 0) <= start_step]
        atomic_write_bytes(out / "metrics.jsonl", "".join(ln + "\n" for ln in keep).encode())


def save_final(method: Method, w, drafter: torch.nn.Module, folder: Path, identity: dict, rank: int) -> None:
    """The trained drafter in the format engines load (the method's `save`), written by rank 0.

    A drafter is built from its config (`type(drafter)(drafter.config)`, as HF models are), so a
    CPU copy takes the full weights whatever ZeRO stage held them."""
    with w.full_weights() as sd:
        if rank == 0:
            cpu = type(drafter)(drafter.config)
            cpu.load_state_dict({k: v.cpu() for k, v in sd.items()})
            method.save(cpu, folder, identity)


def run(cfg: TrainConfig) -> dict:
    """Train; see the module docstring for what comes back. `cfg` is the checked, typed tree
    (draftsmith.configs.check_config: the CLI checks it once, a caller in code calls it first)."""
    out = check_output(cfg)
    method = method_for_config(cfg.method)
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cfg.device == "cuda" else cfg.device  # one per process
    cfg = dataclasses.replace(cfg, device=device, target=dataclasses.replace(cfg.target, device=device))  # beside it
    cfg, resolved = resolve_auto(cfg)
    trainer = TrainerConfig.from_train(cfg)
    rank, world = init_distributed(trainer)

    # prepare: the target, the data, the plan
    target = load_target(cfg.target, layers=method.aux_layer_ids)  # the features the drafter reads
    identity = target.identity()
    train, val, mode = load_data(cfg.data, identity, cfg.mode, cfg.max_length, cfg.val_samples, method.offline_data,
                                 pack_tokens=cfg.pack_tokens)
    if cfg.train_samples is not None:  # a prefix of the training rows (learning curves; the held-out rows stay)
        if cfg.train_samples > len(train.indices):
            raise DraftsmithError(f"train_samples={cfg.train_samples} but {cfg.data} has {len(train.indices)} training "
                                  f"samples (after val_samples={cfg.val_samples}).")
        train.indices = train.indices[:cfg.train_samples]
    total_steps = total_steps_of(cfg, len(train.indices), world)
    compat = compat_fields(cfg, identity, world, len(train.indices), total_steps)

    # resume or start: the drafter (a resumed one keeps its checkpoint's vocab map)
    resume, start_step = find_resume(cfg, out, compat)
    seed_everything(cfg.seed)  # the drafter's fresh layers; resume restores the RNG state later
    drafter = method.new_drafter(target, cfg.method, train, resume).to(cfg.device)
    step_module, prepare = method.training(drafter, target, cfg.method, mode, lambda: autocast(trainer))
    if mode == "offline":
        del target  # what training needs of the target (its lm_head rows) lives on in `prepare`

    # wrap
    w = wrap_for_training(step_module, trainer, world, total_steps)
    if resume is not None:
        load_checkpoint(w, resume, rank)
    config_dict = dataclasses.asdict(cfg)
    if rank == 0:
        start_run_files(cfg, out, resume, start_step)

    # loop (held-out evaluations every eval_every steps keep the best head in out/best) -> save the final drafter
    logger = Logger(trainer, out, rank, total_steps, start_step, config_dict)
    final, best_dir = out / "final", out / "best"
    best = dict(ckpt.read_state(resume).get("best") or {}) if resume is not None else {}
    try:
        record, val_metrics = train_loop(
            w, trainer, train, prepare, method.summarize, out, rank, world, total_steps, start_step,
            {"method": method.name, "compat": compat, "mode": mode, "config": config_dict,
             "layout": {"world_size": world, "grad_accum": cfg.grad_accum}, "resolved": resolved,
             "machine": machine.machine_info(cfg.device)}, logger,
            val=val, best=best, save_best=lambda: save_final(method, w, drafter, best_dir, identity, rank))
        if val is not None and not val_metrics:  # eval_every=0: the held-out rows are evaluated once, here
            val_metrics = evaluate(w, val, prepare, method.summarize, trainer, world)
        save_final(method, w, drafter, final, identity, rank)
    finally:
        logger.close()
        if world > 1:  # a single process keeps its private group: DeepSpeed caches it for later runs in this process
            distributed.close()
    if rank == 0 and val_metrics:
        atomic_write_json(out / "val_metrics.json", val_metrics)
    return {"out": str(out), "final": str(final), "mode": mode, "steps": total_steps, "metrics": record,
            "val": val_metrics, "best": ({**best, "folder": str(best_dir)} if best else None),
            "rank": rank, "world_size": world, "method": method.name, "resolved": resolved}


def summary(result: dict) -> str:
    """The line the CLI prints after training."""
    if result["rank"] != 0:
        return f"train rank {result['rank']}/{result['world_size']}: done."
    val = result.get("val") or {}
    shown = ", ".join(f"{k} {v:.3f}" for k, v in val.items()
                      if k in ("val_loss_0", "val_acc_0", "val_alpha_0", "val_etau_greedy", "val_etau_sample"))
    best = result.get("best")
    return (f"train: {result['method']}, {result['steps']} steps ({result['mode']}); head in {result['final']}"
            + (f"; held-out {shown}" if shown else "")
            + (f"; best held-out {best['metric']} {best['score']:.3f} at step {best['step']} in {best['folder']}"
               if best else ""))

