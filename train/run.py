"""`draftsmith train`: a data-gen folder -> a trained EAGLE-3 head in out/final (+ checkpoints, metrics).

    draftsmith train method=eagle3 target=smollm2 data=runs/smol out=runs/eagle3
    torchrun --nproc_per_node 2 -m draftsmith.cli train ... deepspeed=zero2

Modes: online (the target runs in this process, features per batch under no_grad) and offline
(features read from the data's hidden_states/; the target is loaded once for its embeddings and
lm_head, then only the lm_head is kept to recompute target logits). auto = offline when the data
has hidden states.

run(cfg) returns {"out", "final", "mode", "steps", "metrics" (last step), "val" (held-out, if any)}.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from draftsmith import DraftsmithError
from draftsmith.data_gen.manifest import atomic_write_bytes, atomic_write_json, claim_output, prepare_output
from draftsmith.data_gen.target import load_target
from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
from draftsmith.heads.vocab import build_vocab_map, count_tokens
from draftsmith.train import checkpoint as ckpt
from draftsmith.train.data import load_data
from draftsmith.train.eagle3 import Eagle3Step, TargetHead, summarize
from draftsmith.train.trainer import (Logger, autocast, evaluate, init_distributed, load_checkpoint,
                                      train_loop, wrap_for_training)

METHODS = ("eagle3",)


def validate(cfg) -> None:
    """Refuse bad option values with one sentence naming the option (the checks live in TrainConfig)."""
    from draftsmith.configs import check_config

    check_config("train", cfg)


def compat_fields(cfg, identity: dict, draft_vocab: int, world: int, n_train: int, total_steps: int) -> dict:
    """What a checkpoint must share with this run for exact resume."""
    return {"method": cfg.method, "target_hash": identity["target_hash"], "tokenizer_hash": identity["tokenizer_hash"],
            "hidden_size": identity["hidden_size"], "draft_vocab_size": draft_vocab, "ttt_steps": cfg.ttt_steps,
            "deepspeed": cfg.deepspeed.config, "world_size": world, "micro_batch_size": cfg.micro_batch_size,
            "grad_accum": cfg.grad_accum, "train_samples": n_train, "total_steps": total_steps,
            "precision": cfg.precision, "seed": cfg.seed}


def save_final(head: Eagle3Head, folder: Path, identity: dict) -> Path:
    """The trained head in the engine format vLLM / SGLang load (heads/checkpoint.py)."""
    from draftsmith.heads.checkpoint import save_eagle3

    return save_eagle3(head, folder, manifest_target=identity)


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def close_distributed() -> None:
    """Tear the process group down so every rank exits (gloo ranks otherwise wait at exit).

    A single process keeps its private group: DeepSpeed caches it for later runs in the same process."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run(cfg) -> dict:
    """Train; see the module docstring for what comes back."""
    if not OmegaConf.is_config(cfg):
        cfg = OmegaConf.structured(cfg)
    validate(cfg)
    resume_path = None if str(cfg.resume).lower() in ("none", "false", "no", "0", "", "true", "yes", "1", "latest") \
        else cfg.resume  # resume=<a checkpoint or run folder> is read too
    out = prepare_output(cfg.out, "train", [("data", cfg.data), ("resume", resume_path), ("target", cfg.target.name)],
                         overwrite=bool(getattr(cfg, "overwrite", False)))
    rank, world = init_distributed(cfg)
    if cfg.device == "cuda":  # one device per process
        import os

        cfg.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    cfg.target.device = cfg.device  # the target runs beside the head
    target = load_target(cfg.target)
    identity = target.identity()
    train, val, mode = load_data(cfg.data, identity, cfg.mode, cfg.max_length, cfg.val_samples)

    global_batch = cfg.micro_batch_size * cfg.grad_accum * world
    batches_per_epoch = len(train.indices) // global_batch
    if batches_per_epoch == 0:
        raise DraftsmithError(f"the data has {len(train.indices)} training samples, fewer than one global batch "
                              f"(micro_batch_size x grad_accum x world_size = {global_batch}).")
    total_steps = cfg.max_steps if cfg.max_steps is not None else cfg.epochs * batches_per_epoch
    draft_vocab = min(cfg.draft_vocab_size, target.vocab_size)
    compat = compat_fields(cfg, identity, draft_vocab, world, len(train.indices), total_steps)

    # Resume (checked before anything is written) or a fresh run in a folder without checkpoints.
    resume = ckpt.resolve_resume(cfg.resume, out)
    if resume is not None:
        state = ckpt.read_state(resume)
        ckpt.check_compatible(state, compat, resume)
        from safetensors.torch import load_file

        saved = load_file(str(resume / "head.safetensors"))
        d2t, t2d = saved["d2t"], saved["t2d"]  # never rebuilt on resume
    else:
        if ckpt.list_checkpoints(out):
            raise DraftsmithError(f"out={str(out)!r} already holds training checkpoints; pass resume=true or choose another out.")
        state = {"step": 0}
        rows = train.indices
        counts = count_tokens((train.input_ids[i] for i in rows), (train.loss_mask[i] for i in rows), target.vocab_size)
        d2t, t2d = build_vocab_map(counts, draft_vocab)

    seed_everything(cfg.seed)  # the head's fresh layers; resume restores the RNG state later
    head = Eagle3Head(eagle3_config_from_target(target.model.config, draft_vocab))
    head.init_from_target(target.model, d2t, t2d)
    head.to(cfg.device)
    target_head = TargetHead(target.model.get_output_embeddings().weight, head.t2d)
    if mode == "offline":
        target = None  # the lm_head rows live on in target_head; the body is not needed

    def prepare(batch: dict) -> dict:
        """Add the target side (features in online mode, distributions always) under no_grad."""
        with torch.no_grad():
            if mode == "online":
                with autocast(cfg):
                    aux, last = target.features(batch["input_ids"], batch["attention_mask"])
            else:
                aux, last = batch.pop("aux"), batch.pop("last")
            batch.pop("last", None)
            return {**batch, "aux": aux, "target": target_head(last)}

    w = wrap_for_training(Eagle3Step(head, cfg.ttt_steps, cfg.ttt_decay), cfg, world, total_steps)
    if resume is not None:
        load_checkpoint(w, resume, rank)

    config_dict = OmegaConf.to_container(cfg, resolve=True)
    if rank == 0:
        claim_output(out, "train")  # creates out/, marked as train's own output
        if resume is None:  # a fresh run (perhaps in its own earlier output): a new log
            (out / "metrics.jsonl").unlink(missing_ok=True)
            (out / "val_metrics.json").unlink(missing_ok=True)
        atomic_write_bytes(out / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True).encode())
        if resume is not None and (out / "metrics.jsonl").is_file():  # drop records past the checkpoint
            import json

            lines = (out / "metrics.jsonl").read_text().splitlines()
            keep = [ln for ln in lines if json.loads(ln).get("step", 0) <= state["step"]]
            atomic_write_bytes(out / "metrics.jsonl", "".join(ln + "\n" for ln in keep).encode())
    logger = Logger(cfg, out, rank, total_steps, state["step"], config_dict)
    try:
        record = train_loop(w, cfg, train, prepare, summarize, out, rank, world, total_steps, state["step"],
                            {"method": cfg.method, "compat": compat, "mode": mode, "config": config_dict}, logger)
        val_metrics = evaluate(w, val, prepare, summarize, cfg, world) if val is not None else {}
        final = out / "final"
        with w.full_weights() as sd:
            if rank == 0:
                head_cpu = Eagle3Head(head.config)
                head_cpu.load_state_dict({k: v.cpu() for k, v in sd.items()})
                save_final(head_cpu, final, identity)
    finally:
        logger.close()
        if world > 1:
            close_distributed()
    if rank == 0 and val_metrics:
        atomic_write_json(out / "val_metrics.json", val_metrics)
    return {"out": str(out), "final": str(final), "mode": mode, "steps": total_steps, "metrics": record,
            "val": val_metrics, "rank": rank, "world_size": world}
