"""`draftsmith demo`: data-gen -> EAGLE-3 training -> eval on the embedded SmolLM2, on a laptop CPU.

    draftsmith demo                      # ~20 minutes on 2 CPU cores; out=runs/demo
    draftsmith demo flavour=smollm2-long # ~23 minutes on 2 CPU cores: the learning curve's largest point
    draftsmith demo flavour=tiny         # the random tiny target, a few steps: CI, < 1 minute

Stages and their folders under `out/`:
  data/  `draftsmith data-gen prompts=self hidden_states=true`: the target writes n_prompts + eval_prompts
         questions and answers them (batched bf16 generation), then its features are captured once;
  head/  `draftsmith train method=eagle3 mode=offline val_samples=eval_prompts`: EAGLE-3 training on all
         rows but the last `eval_prompts` (out/head/final is the head);
  eval/  `draftsmith eval prompts.source=holdout prompts.holdout=eval_prompts`: the held-out rows'
         prompts, temperature 0, chain drafting, against target-only decoding.

Each stage is skipped when its output is complete and was made with the same settings (a stamp
`out/<stage>.done.json` holds the overrides it ran with) from unchanged inputs; an interrupted
stage resumes (data-gen its parts, training its latest checkpoint); a stage finished with other
settings, or whose input was just remade, is redone from scratch (the demo then removes only what that
stage wrote). `out` and its three folders must be new, empty or the demo's (the stage's) own earlier
output; anything else is refused before any work unless overwrite=true, and no user file is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from draftsmith import DraftsmithError
from draftsmith import artifacts as mf
from draftsmith.artifacts import atomic_write_bytes, atomic_write_json

# Sizes of each flavour; a DemoConfig knob left at None takes its flavour's value.
FLAVOURS = {
    # Sized from the measured learning curve (scripts/bench_learning_curve.py, README "Learning curve") to
    # fit 20 minutes on 2 idle CPU cores: data-gen ~1.05 s per sample at batch 32 in bf16 (writing the prompt,
    # answering it, capturing its features), an offline bf16 training step ~0.41 s, eval ~2.5 min; measured
    # end to end: 17 min 36 s.
    # 480 samples seen twice; adjust n_prompts / train_steps if your CPU is slower. lr 3e-3: the best held-out
    # E[tau] per minute of training among 3e-4 / 1e-3 / 3e-3 (scripts/bench_sample_efficiency.py).
    "smollm2": dict(target="smollm2", n_prompts=480, max_prompt_tokens=64, eval_prompts=10, gen_max_new_tokens=128,
                    train_steps=960,
                    lr=3e-3, draft_vocab_size=8192, max_length=384, train_precision="bf16", train_mode="offline",
                    gen_batch_size=32, eval_max_new_tokens=96, repeats=1),
    # The learning curve's largest point as a demo: 720 samples seen twice, lr 1e-3 as the curve was measured
    # (23 min 26 s on 2 idle cores, 2026-11-30: tau 1.61, 1.17x; n-gram 1.24x on the same prompts).
    "smollm2-long": dict(target="smollm2", n_prompts=720, max_prompt_tokens=64, eval_prompts=10,
                         gen_max_new_tokens=128, train_steps=1440,
                         lr=1e-3, draft_vocab_size=8192, max_length=384, train_precision="bf16", train_mode="offline",
                         gen_batch_size=32, eval_max_new_tokens=96, repeats=1),
    # The random tiny target: the whole pipeline in well under a minute, for CI.
    "tiny": dict(target="tiny", n_prompts=6, max_prompt_tokens=16, eval_prompts=2, gen_max_new_tokens=8, train_steps=3,
                 lr=1e-3, draft_vocab_size=128, max_length=128, train_precision="fp32", train_mode="offline",
                 gen_batch_size=4, eval_max_new_tokens=12, repeats=1),
}


@dataclass
class DemoConfig:
    flavour: str = "smollm2"  # smollm2 | smollm2-long | tiny (sizes below default to the flavour's)
    out: str = "runs/demo"  # output folder: data/, head/, eval/
    overwrite: bool = False  # true: use an out folder (and data/, head/, eval/ in it) the demo did not make
    seed: int = 0  # of every stage
    n_prompts: Optional[int] = None  # self-written training prompts
    max_prompt_tokens: Optional[int] = None  # length cap of a self-written prompt
    eval_prompts: Optional[int] = None  # more self-written prompts, held out for eval
    gen_max_new_tokens: Optional[int] = None  # answer length in data-gen
    train_steps: Optional[int] = None  # optimizer steps of the training
    lr: Optional[float] = None  # peak learning rate of the training
    draft_vocab_size: Optional[int] = None  # the head's draft vocabulary
    max_length: Optional[int] = None  # training sequence length
    train_precision: Optional[str] = None  # fp32 | bf16
    train_mode: Optional[str] = None  # offline (data-gen captures the target's features once) | online
    gen_batch_size: Optional[int] = None  # data-gen's backend.batch_size (rows decoded together)
    eval_max_new_tokens: Optional[int] = None  # answer length in eval
    repeats: Optional[int] = None  # eval timing repeats
    num_speculative_tokens: int = 3  # few: a demo-sized head accepts little past the first draft
    progress: bool = True  # show progress bars

    def __post_init__(self):
        from draftsmith import checks

        checks.one_of("flavour", self.flavour, FLAVOURS)
        checks.at_least("n_prompts", self.n_prompts, 2, null="the flavour's")
        for name in ("max_prompt_tokens", "eval_prompts", "gen_max_new_tokens", "train_steps", "draft_vocab_size",
                     "max_length", "eval_max_new_tokens", "repeats", "gen_batch_size"):
            checks.at_least(name, getattr(self, name), 1, null="the flavour's")
        checks.positive("lr", self.lr, null="the flavour's")
        if self.train_precision is not None:
            checks.one_of("train_precision", self.train_precision, ("fp32", "bf16"))
        if self.train_mode is not None:
            checks.one_of("train_mode", self.train_mode, ("offline", "online"))
        checks.in_range("num_speculative_tokens", self.num_speculative_tokens, 1, 64)


def sizes(cfg) -> dict:
    """The flavour's sizes with the user's explicit knobs on top."""
    if cfg.flavour not in FLAVOURS:
        raise DraftsmithError(f"flavour={cfg.flavour!r} is not one of {', '.join(FLAVOURS)}.")
    s = dict(FLAVOURS[cfg.flavour])
    for key in s:
        value = getattr(cfg, key, None)
        if value is not None:
            s[key] = value
    if s["n_prompts"] < 2 or s["eval_prompts"] < 1 or s["train_steps"] < 1:
        raise DraftsmithError("n_prompts must be >= 2, eval_prompts >= 1 and train_steps >= 1.")
    return s


def stage_overrides(cfg, s: dict, out: Path) -> dict[str, list[str]]:
    """The overrides each stage runs with: data_gen, train and eval configs composed as their CLIs would."""
    target = f"target={s['target']}"
    return {
        "data_gen": [target, "prompts=self", f"prompts.n={s['n_prompts'] + s['eval_prompts']}",
                     f"prompts.seed={cfg.seed}", f"prompts.max_prompt_tokens={s['max_prompt_tokens']}", f"seed={cfg.seed}", f"max_new_tokens={s['gen_max_new_tokens']}",
                     "target.dtype=bfloat16" if s["target"] == "smollm2" else "target.dtype=float32",
                     f"backend.batch_size={s['gen_batch_size']}", f"regenerate_chunk={4 * s['gen_batch_size']}",
                     f"hidden_states={str(s['train_mode'] == 'offline').lower()}", f"out={out / 'data'}"],
        "train": ["method=eagle3", target, f"data={out / 'data'}", f"out={out / 'head'}", f"mode={s['train_mode']}",
                  "deepspeed=none",  # one process on CPU: plain torch
                  f"max_steps={s['train_steps']}", f"lr={s['lr']}", "warmup_ratio=0.05",
                  f"method.draft_vocab_size={s['draft_vocab_size']}", f"max_length={s['max_length']}",
                  f"val_samples={s['eval_prompts']}", f"precision={s['train_precision']}", f"seed={cfg.seed}",
                  "wandb.mode=disabled", f"progress={str(cfg.progress).lower()}", "save_every=100000"],
        "eval": [target, f"head={out / 'head' / 'final'}", "prompts.source=holdout", f"prompts.path={out / 'data'}",
                 f"prompts.holdout={s['eval_prompts']}", "prompts.n=null", "temperature=0", "drafting.mode=chain",
                 f"drafting.num_speculative_tokens={cfg.num_speculative_tokens}",
                 f"max_new_tokens={s['eval_max_new_tokens']}", f"repeats={s['repeats']}", "baselines=[ngram]",
                 f"seed={cfg.seed}", f"progress={str(cfg.progress).lower()}", f"out={out / 'eval'}"],
    }


FOLDERS = {"data_gen": "data", "train": "head", "eval": "eval"}
# What a redo removes from a stage's folder: only what that stage writes (a file the user put there stays).
# data-gen: nothing, its own resume redoes exactly what the changed settings affect.
STAGE_FILES = {
    "data_gen": (),
    "train": ("checkpoints", "final", "best", "metrics.jsonl", "val_metrics.json", "config.yaml", "wandb"),
    "eval": ("report.json", "report.md", "report.png", "manifest.json", "config.yaml"),
}


def clear_stage(folder: Path, stage: str) -> None:
    """Remove `stage`'s earlier output from `folder` so it is redone from scratch; refuse a folder it did not make."""
    if not folder.is_dir():
        return
    if not mf.is_empty(folder) and not mf.owns(folder, stage):
        raise mf.not_owned_error(folder, stage)
    for name in STAGE_FILES[stage]:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()


def _done(out: Path, stage: str, overrides: list[str]) -> bool:
    stamp = out / f"{stage}.done.json"
    return stamp.is_file() and json.loads(stamp.read_text()).get("overrides") == overrides


def _run_stage(stage: str, overrides: list[str]) -> dict:
    from importlib import import_module

    from draftsmith.configs import compose

    module = {"data_gen": "draftsmith.data_gen.run", "train": "draftsmith.train.run", "eval": "draftsmith.eval.run"}
    return import_module(module[stage]).run(compose(stage, overrides))


def run(cfg) -> dict:
    """Run (or skip / resume) the three stages; returns {stage: seconds, ..., "report": eval report}."""
    s = sizes(cfg)
    overwrite = bool(getattr(cfg, "overwrite", False))
    out = mf.prepare_output(cfg.out, "demo", overwrite=overwrite)
    for stage, name in FOLDERS.items():  # each stage's folder: new, empty or that stage's own (before any work)
        mf.prepare_output(out / name, stage, overwrite=overwrite)
    mf.claim_output(out, "demo")
    if overwrite:  # the stages then write into these folders as their own
        for stage, name in FOLDERS.items():
            if (out / name).is_dir() and not mf.owns(out / name, stage):
                mf.claim_output(out / name, stage)
    atomic_write_bytes(out / "config.yaml", OmegaConf.to_yaml(cfg).encode())
    plan = stage_overrides(cfg, s, out)
    result: dict = {"out": str(out), "flavour": cfg.flavour, "sizes": s, "seconds": {}, "skipped": []}
    t_all = time.perf_counter()
    upstream_ran = False
    for stage, overrides in plan.items():
        if not upstream_ran and _done(out, stage, overrides):
            result["skipped"].append(stage)
            continue
        stamp = out / f"{stage}.done.json"
        if stamp.is_file() or upstream_ran:  # finished with other settings, or its input changed: redo it
            stamp.unlink(missing_ok=True)
            clear_stage(out / FOLDERS[stage], stage)
        upstream_ran = True
        if stage == "train":
            from draftsmith.train.checkpoint import list_checkpoints

            if list_checkpoints(out / "head"):
                overrides = overrides + ["resume=true"]
        t0 = time.perf_counter()
        done = _run_stage(stage, overrides)
        result["seconds"][stage] = round(time.perf_counter() - t0, 1)
        if stage == "train":
            result["train"] = {"steps": done.get("steps"), "val": done.get("val")}
        atomic_write_json(out / f"{stage}.done.json", {"overrides": plan[stage], "seconds": result["seconds"][stage]})
    result["seconds"]["total"] = round(time.perf_counter() - t_all, 1)
    result["report"] = json.loads((out / "eval" / "report.json").read_text())
    atomic_write_json(out / "demo_summary.json", {k: v for k, v in result.items() if k != "report"})
    return result


def summary(result: dict) -> str:
    """The few lines the demo ends with (the CLI prints them): tau, per-position acceptance, speedup, the report."""
    r = result["report"]
    acc = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
    ngram = r.get("baselines", {}).get("ngram")
    lines = [
        f"draftsmith demo ({result['flavour']}): EAGLE-3 head on {r['target']['target_id']}, "
        f"{r['n_prompts']} held-out prompts, temperature {r['temperature']}, chain K={r['drafting']['num_speculative_tokens']}",
        f"  tau (tokens per target verification, bonus included): {r['tau']:.2f}",
        f"  per-position acceptance: {acc}",
        f"  speedup: {r['speedup']:.2f}x ({r['speculative_tokens_per_s']:.1f} vs {r['target_only_tokens_per_s']:.1f} "
        f"tokens/s target-only, same decoder)",
    ]
    if ngram:
        lines.append(f"  n-gram lookup baseline (no training): tau {ngram['tau']:.2f}, speedup {ngram['speedup']:.2f}x")
    secs = ", ".join(f"{k} {v:.0f} s" for k, v in result["seconds"].items())
    skipped = f" (skipped, already complete: {', '.join(result['skipped'])})" if result["skipped"] else ""
    lines.append(f"  time: {secs}{skipped}")
    lines.append(f"  report: {Path(result['out']) / 'eval' / 'report.md'}")
    return "\n".join(lines)
