"""`draftsmith demo`: data-gen -> EAGLE-3 training -> eval on the embedded SmolLM2, on a laptop CPU.

    draftsmith demo                       # sized to budget_min=20 minutes on this machine; out=runs/demo
    draftsmith demo budget_min=10         # a smaller plan
    draftsmith demo flavour=smollm2-fixed # the fixed sizes of the earlier demo figures (480 prompts, 960 steps)
    draftsmith demo flavour=smollm2-long  # the learning curve's largest point (720 prompts, 1440 steps)
    draftsmith demo flavour=tiny          # the random tiny target, a few steps: CI, < 1 minute

Sizing (flavour smollm2): a calibration run of the same three stages (out/calibration/: one data-gen batch, a
few training steps, one short eval) measures this machine's rates; `plan_sizes` then picks the training prompts
and steps (two epochs) that end the whole demo within budget_min, prints the plan with the measured rates and
saves it in out/plan.json (a rerun with the same settings reuses it, so its stages are skipped or resumed). Once
data-gen has run, `resize_training` re-sizes the training steps to the time really left (1 to 4 epochs).

Stages and their folders under `out/`:
  data/  `draftsmith data-gen prompts=self hidden_states=true`: the target writes n_prompts + eval_prompts
         questions and answers them (batched generation, dtype auto), then its features are captured once;
  head/  `draftsmith train method=eagle3 mode=offline val_samples=eval_prompts`: EAGLE-3 training on all
         rows but the last `eval_prompts` (out/head/final is the head);
  eval/  `draftsmith eval prompts.source=holdout prompts.holdout=eval_prompts baselines=[ngram,ngram+head]`: the
         held-out rows' prompts, temperature 0, chain drafting: the head, n-gram lookup and n-gram + head against
         target-only decoding (the summary names the fastest).

Each stage is skipped when its output is complete and was made with the same settings (a stamp
`out/<stage>.done.json` holds the overrides it ran with) from unchanged inputs; an interrupted
stage resumes (data-gen its parts, training its latest checkpoint); a stage finished with other
settings, or whose input was just remade, is redone from scratch (the demo then removes only what that
stage wrote). `out` and its three folders must be new, empty or the demo's (the stage's) own earlier
output; anything else is refused before any work unless overwrite=true, and no user file is removed.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from omegaconf import OmegaConf

from draftsmith.core import DraftsmithError, checks, llamacpp
from draftsmith.core import artifacts as mf
from draftsmith.core.artifacts import atomic_write_bytes, atomic_write_json
from draftsmith.configs import compose
from draftsmith.data_gen.run import run as data_gen_run
from draftsmith.data_gen.target import load_target
from draftsmith.core.engine import NUM_SPECULATIVE_TOKENS
from draftsmith.eval.config import check_gguf_outtypes
from draftsmith.eval.run import run as eval_run
from draftsmith.train.checkpoint import list_checkpoints
from draftsmith.train.run import run as train_run

# Sizes of each flavour; a DemoConfig knob left at None takes its flavour's value. A flavour with
# "budget": True is sized to `budget_min` on the machine it runs on (plan_sizes below): its n_prompts and
# train_steps are only the values the plan starts from.
SMOLLM2 = dict(target="smollm2", n_prompts=480, max_prompt_tokens=64, eval_prompts=10, gen_max_new_tokens=128,
               train_steps=960, lr=3e-3, draft_vocab_size=8192, max_length=384, train_precision="auto",
               train_mode="offline", gen_batch_size=64, eval_max_new_tokens=96, repeats=1)
FLAVOURS = {
    # The default: the sizes below scaled to fit budget_min on this machine, from rates measured by a
    # calibration run of the same three stages (out/calibration/) at the start. Two epochs over the data (the
    # learning curve's recipe, benchmarks/bench_learning_curve.py); lr 3e-3: the best held-out E[tau] per minute of
    # training among 3e-4 / 1e-3 / 3e-3 (benchmarks/bench_sample_efficiency.py).
    "smollm2": dict(SMOLLM2, budget=True),
    # The fixed sizes the earlier demo figures (docs/benchmarks.md) were measured with (17 min 36 s on a 2-core Xeon with
    # AMX-bf16, 2026-11-30): 480 samples seen twice. On a CPU without native bf16 it takes far longer.
    "smollm2-fixed": dict(SMOLLM2, budget=False),
    # The learning curve's largest point as a demo: 720 samples seen twice, lr 1e-3 as the curve was measured
    # (23 min 26 s on 2 idle cores with AMX-bf16, 2026-11-30: tau 1.61, 1.17x; n-gram 1.24x on the same prompts).
    "smollm2-long": dict(SMOLLM2, n_prompts=720, train_steps=1440, lr=1e-3, budget=False),
    # The random tiny target: the whole pipeline in well under a minute, for CI.
    "tiny": dict(target="tiny", n_prompts=6, max_prompt_tokens=16, eval_prompts=2, gen_max_new_tokens=8, train_steps=3,
                 lr=1e-3, draft_vocab_size=128, max_length=128, train_precision="fp32", train_mode="offline",
                 gen_batch_size=4, eval_max_new_tokens=12, repeats=1, budget=False),
}
# What the calibration run changes in a budgeted flavour: one data-gen batch, a few training steps, one short eval.
CALIBRATION_STEPS = 6
CALIBRATION_EVAL_TOKENS = 32
PLAN = "plan.json"


@dataclass
class DemoConfig:
    flavour: str = "smollm2"  # smollm2 (sized to budget_min) | smollm2-fixed | smollm2-long | tiny
    budget_min: Optional[float] = 20.0  # wall minutes a budgeted flavour is sized to (null: the flavour's sizes)
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
    train_precision: Optional[str] = None  # auto | fp32 | bf16
    train_mode: Optional[str] = None  # offline (data-gen captures the target's features once) | online
    gen_batch_size: Optional[int] = None  # data-gen's backend.batch_size (rows decoded together)
    eval_max_new_tokens: Optional[int] = None  # answer length in eval
    repeats: Optional[int] = None  # eval timing repeats
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS  # K (3: a demo-sized head accepts little past the first)
    # llama.cpp (where built): the head's GGUF types measured side by side, e.g. [f32,f16,bf16,q8_0]; null: eval's
    # default, export's one type (q8_0). Each type adds a head run and a head + n-gram run (~1 min each, 2 cores)
    gguf_outtypes: Optional[list[str]] = None
    progress: bool = True  # show progress bars

    def __post_init__(self):
        checks.one_of("flavour", self.flavour, FLAVOURS)
        checks.at_least("n_prompts", self.n_prompts, 2, null="the flavour's")
        for name in ("max_prompt_tokens", "eval_prompts", "gen_max_new_tokens", "train_steps", "draft_vocab_size",
                     "max_length", "eval_max_new_tokens", "repeats", "gen_batch_size"):
            checks.at_least(name, getattr(self, name), 1, null="the flavour's")
        checks.positive("lr", self.lr, null="the flavour's")
        if self.train_precision is not None:
            checks.one_of("train_precision", self.train_precision, ("auto", "fp32", "bf16"))
        if self.train_mode is not None:
            checks.one_of("train_mode", self.train_mode, ("offline", "online"))
        checks.in_range("num_speculative_tokens", self.num_speculative_tokens, 1, 64)
        checks.positive("budget_min", self.budget_min, null="no budget")
        if self.gguf_outtypes is not None:
            check_gguf_outtypes(list(self.gguf_outtypes))


def sizes(cfg) -> dict:
    """The flavour's sizes with the user's explicit knobs on top."""
    if cfg.flavour not in FLAVOURS:
        raise DraftsmithError(f"flavour={cfg.flavour!r} is not one of {', '.join(FLAVOURS)}.")
    s: dict = dict(FLAVOURS[cfg.flavour])
    for key in s:
        value = getattr(cfg, key, None)
        if value is not None:
            s[key] = value
    # Sized to the budget unless asked not to, or unless the user fixed the sizes the plan would choose.
    s["budget"] = bool(s["budget"]) and cfg.budget_min is not None and cfg.n_prompts is None and cfg.train_steps is None
    if s["n_prompts"] < 2 or s["eval_prompts"] < 1 or s["train_steps"] < 1:
        raise DraftsmithError("n_prompts must be >= 2, eval_prompts >= 1 and train_steps >= 1.")
    return s


def stage_overrides(cfg, s: dict, out: Path) -> dict[str, list[str]]:
    """The overrides each stage runs with: data_gen, train and eval configs composed as their CLIs would."""
    target = f"target={s['target']}"
    return {
        "data_gen": [target, "prompts=self", f"prompts.n={s['n_prompts'] + s['eval_prompts']}",
                     f"prompts.seed={cfg.seed}", f"prompts.max_prompt_tokens={s['max_prompt_tokens']}", f"seed={cfg.seed}", f"max_new_tokens={s['gen_max_new_tokens']}",
                     "target.dtype=auto" if s["target"] == "smollm2" else "target.dtype=float32",
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
                 f"max_new_tokens={s['eval_max_new_tokens']}", f"repeats={s['repeats']}",
                 "baselines=[ngram,ngram+head]",  # the head, n-gram lookup and n-gram + head, side by side
                 f"seed={cfg.seed}", f"progress={str(cfg.progress).lower()}", f"out={out / 'eval'}"]
                + llamacpp_overrides(s, cfg.gguf_outtypes),
    }


def llamacpp_overrides(s: dict, gguf_outtypes: Optional[list[str]] = None) -> list[str]:
    """The embedded SmolLM2 is also measured in llama.cpp, the engine CPU users serve its GGUF in, where it is built:
    its own Q4_1 file as the target, beside the head (at each of `gguf_outtypes`, else export's type), n-gram and
    head + n-gram (eval engine=llamacpp)."""
    if s["target"] != "smollm2" or llamacpp.llamacpp_missing() is not None:
        return []
    types = [f"gguf_outtypes=[{','.join(gguf_outtypes)}]"] if gguf_outtypes else []
    return ["engine=llamacpp", "llamacpp_target=same", *types]


FOLDERS = mf.DEMO_FOLDERS  # {"data_gen": "data", "train": "head", "eval": "eval"}: core lists what each writes
# What a redo removes from a stage's folder: only what that stage writes (a file the user put there stays).
# data-gen: nothing, its own resume redoes exactly what the changed settings affect.
STAGE_FILES = {
    "data_gen": (),
    "train": ("checkpoints", "final", "best", "metrics.jsonl", "val_metrics.json", "config.yaml", "wandb"),
    "eval": ("report.json", "report.md", "report.png", "manifest.json", "config.yaml"),
}
# Inside those folders a redo removes what their record lists (final/, best/, each checkpoint), or else
# only these names (checkpoints older than records; wandb's own files).
STAGE_FILES_INSIDE = {"checkpoints": ("step_*", ".tmp-step_*"),
                      "wandb": ("run-*", "offline-run-*", "latest-run", "debug*.log")}


def clear_stage(folder: Path, stage: str) -> None:
    """Remove `stage`'s earlier output from `folder` so it is redone from scratch; refuse a folder it did not make."""
    if not folder.is_dir():
        return
    if not mf.is_empty(folder) and not mf.owns(folder, stage):
        raise mf.not_owned_error(folder, stage)
    for name in STAGE_FILES[stage]:  # (never through a link: a link itself goes, what it points to stays)
        mf.remove_written(folder / name, STAGE_FILES_INSIDE.get(name, ()))


def _done(out: Path, stage: str, overrides: list[str]) -> bool:
    stamp = out / f"{stage}.done.json"
    return stamp.is_file() and json.loads(stamp.read_text()).get("overrides") == overrides


def _run_stage(stage: str, overrides: list[str]) -> dict:
    # each takes its own stage's config, the tree compose returns
    runners: dict[str, Callable[..., dict]] = {"data_gen": data_gen_run, "train": train_run, "eval": eval_run}
    runner = runners[stage]
    return runner(compose(stage, overrides))


def run_stages(cfg, s: dict, out: Path, before_train=None) -> dict:
    """Run (or skip / resume) the three stages with sizes `s` into `out`; returns seconds, skips, the sizes the
    stages ran with and the report. `before_train(s, data_gen_ran)`, if given, returns the sizes training and eval
    run with (the budget re-sizes the training once data-gen's real time is known)."""
    result: dict = {"seconds": {}, "skipped": []}
    upstream_ran = False
    for stage in FOLDERS:
        if stage == "train" and before_train is not None:
            s = before_train(s, upstream_ran)
        overrides = stage_overrides(cfg, s, out)[stage]
        stamp_overrides = overrides
        if not upstream_ran and _done(out, stage, overrides):
            result["skipped"].append(stage)
            continue
        stamp = out / f"{stage}.done.json"
        if stamp.is_file() or upstream_ran:  # finished with other settings, or its input changed: redo it
            stamp.unlink(missing_ok=True)
            clear_stage(out / FOLDERS[stage], stage)
        upstream_ran = True
        if stage == "train" and list_checkpoints(out / "head"):
            overrides = overrides + ["resume=true"]
        t0 = time.perf_counter()
        done = _run_stage(stage, overrides)
        result["seconds"][stage] = round(time.perf_counter() - t0, 1)
        if stage == "train":
            result["train"] = {"steps": done.get("steps"), "val": done.get("val")}
        atomic_write_json(out / f"{stage}.done.json", {"overrides": stamp_overrides, "seconds": result["seconds"][stage]})
    result["sizes"] = s
    result["report"] = json.loads((out / "eval" / "report.json").read_text())
    return result


def check_demo_folder(out: Path, overwrite: bool) -> None:
    """Check `out`'s stage folders before any work: each new, empty or that stage's own (in a user's folder, with
    overwrite=true, none of the user's files under a name that stage writes)."""
    for stage, name in FOLDERS.items():
        mf.prepare_output(out / name, stage, overwrite=overwrite)


def prepare_demo_folder(out: Path, overwrite: bool) -> None:
    """Mark `out` and its stage folders (checked: check_demo_folder) as the demo's (and the stages')."""
    mf.claim_output(out, "demo")
    mf.clean_temporaries(out, ("config.yaml", "*.done.json", "demo_summary.json", mf.OWNER))  # a killed run's leftovers
    if overwrite:  # the stages then write into these folders as their own
        for stage, name in FOLDERS.items():
            if (out / name).is_dir() and not mf.owns(out / name, stage):
                mf.claim_output(out / name, stage)


def run(cfg: DemoConfig) -> dict:
    """Run (or skip / resume) the three stages, sized to the budget first where the flavour asks for it; returns
    {"seconds": {stage: s, "total": s}, "skipped": [...], "plan": ... (budgeted flavours), "report": eval report}."""
    s = sizes(cfg)
    overwrite = cfg.overwrite
    out = mf.prepare_output(cfg.out, "demo", overwrite=overwrite)
    folders = [out, *([mf.prepare_output(out / "calibration", "demo", overwrite=overwrite)] if s["budget"] else [])]
    for folder in folders:  # every folder is checked before the first is claimed
        check_demo_folder(folder, overwrite)
    for folder in folders:
        prepare_demo_folder(folder, overwrite)
    atomic_write_bytes(out / "config.yaml", OmegaConf.to_yaml(cfg).encode())
    t_all = time.perf_counter()
    plan = None
    if s["budget"]:
        plan = budget_plan(cfg, s, out, t_all)
        s = dict(s, n_prompts=plan["n_prompts"], train_steps=plan["train_steps"])

    def before_train(s: dict, data_gen_ran: bool) -> dict:
        """A budgeted demo re-sizes its training to the time data-gen left (a rerun that skipped data-gen keeps
        the steps its plan.json saved)."""
        if plan is None or not data_gen_ran:
            return s
        assert cfg.budget_min is not None  # a plan is made for a budget only (sizes)
        plan.update(resize_training(plan, cfg.budget_min * 60.0, time.perf_counter() - t_all))
        atomic_write_json(out / PLAN, {"key": plan_key(cfg, sizes(cfg)),
                                       "plan": {k: v for k, v in plan.items() if k != "calibrated_now"}})
        print(resized_text(plan), file=sys.stderr)
        return dict(s, train_steps=plan["train_steps"])
    result = {"out": str(out), "flavour": cfg.flavour, **run_stages(cfg, s, out, before_train)}
    if plan is not None:
        result["plan"] = plan
        result["seconds"] = {"calibration": plan["calibration_s"] if plan["calibrated_now"] else 0.0,
                             **result["seconds"]}
    result["seconds"]["total"] = round(time.perf_counter() - t_all, 1)
    atomic_write_json(out / "demo_summary.json", {k: v for k, v in result.items() if k != "report"})
    return result


# ---------------------------------------------------------------------------------------------
# Sizing to the budget: a calibration run of the same three stages measures this machine's rates, then the
# data and the training steps are chosen so that the whole demo ends within budget_min.

@dataclass
class Rates:
    """What the calibration run measured on this machine, in seconds."""
    load_s: float  # one load of the target (each stage loads it once)
    data_gen_s_per_sample: float  # writing one prompt, answering it and capturing its features, at gen_batch_size
    train_step_s: float  # one optimizer step (mean of the calibration's steps after the first)
    train_fixed_s: float  # the training stage's cost besides its steps (loads, held-out evaluation, saving)
    eval_fixed_s: float  # eval's cost that does not grow with the answers' length (loads, warm-up, cost model)
    eval_s_per_token: float  # decoding one new token target-only, speculatively and with n-gram, summed


def calibration_sizes(s: dict) -> dict:
    """The calibration run: one data-gen batch (+1 held-out prompt), a few training steps, one short eval."""
    return dict(s, n_prompts=s["gen_batch_size"], eval_prompts=1, train_steps=CALIBRATION_STEPS,
                eval_max_new_tokens=min(CALIBRATION_EVAL_TOKENS, s["eval_max_new_tokens"]), budget=False)


def measured_rates(calib: dict, calib_out: Path, cs: dict, load_s: float) -> Rates:
    """Rates from a finished calibration run (`calib`: run_stages' result, `cs`: its sizes)."""
    secs = calib["seconds"]
    steps = [json.loads(line)["step_s"] for line in (calib_out / "head" / "metrics.jsonl").read_text().splitlines()
             if line.strip() and "step_s" in json.loads(line)]
    timed = steps[1:] or steps  # the first step pays for warm-up
    # the mean, not the median: the total is what the plan needs, and slow steps (long samples) count in it.
    # Measured 2026-12-01 (2-core Xeon, AMX): the calibration's mean 0.31 s/step against the real run's 0.375.
    step_s = sum(timed) / len(timed)
    r = calib["report"]
    decoders = [r["target_only_tokens_per_s"], r["speculative_tokens_per_s"]]
    decoders += [b["tokens_per_s"] for b in (r.get("baselines") or {}).values() if b.get("tokens_per_s")]
    # llama.cpp's runs decode the same tokens again (target-only and each drafter); counted as fixed, they made
    # the eval estimate 170 s where eval took 356 s (2-core Xeon, 2026-12-05)
    e = r.get("llamacpp") or {}
    decoders += [x for x in [e.get("target_only_tokens_per_s")] + [run.get("speculative_tokens_per_s") for run in
                 (e.get("runs") or {}).values()] if x]
    per_token = sum(1.0 / max(tps, 1e-6) for tps in decoders) * cs["repeats"]
    decoded = cs["eval_prompts"] * cs["eval_max_new_tokens"]
    # The load is timed apart from the stage: on a busy machine (a test suite on both cores) it measured longer than
    # the whole data-gen of a tiny target, and the rate came out 0. Then the whole stage counts as samples: an
    # over-estimate, on the safe side of the budget.
    data_gen_s = secs["data_gen"] - load_s if secs["data_gen"] > load_s else secs["data_gen"]
    return Rates(
        load_s=load_s,
        data_gen_s_per_sample=data_gen_s / (cs["n_prompts"] + cs["eval_prompts"]),
        train_step_s=step_s,
        train_fixed_s=max(secs["train"] - sum(steps), 0.0),
        eval_fixed_s=max(secs["eval"] - per_token * decoded, 0.0),
        eval_s_per_token=per_token,
    )


MIN_PROMPTS = 32  # below this a head learns next to nothing: the plan then says it will overrun


def plan_sizes(s: dict, budget_s: float, spent_s: float, rates: Rates, margin: float = 0.08) -> dict:
    """The training prompts and steps that fit what is left of `budget_s` (pure: the rates are given).

    Keeps the flavour's epochs (train_steps / n_prompts) and eval size; `margin` of the budget is kept free
    for what the rates do not capture (answers longer than the calibration's, a busier machine)."""
    epochs = s["train_steps"] / s["n_prompts"]
    eval_s = rates.eval_fixed_s + rates.eval_s_per_token * s["eval_prompts"] * s["eval_max_new_tokens"]
    fixed_s = rates.load_s + rates.train_fixed_s + eval_s + rates.data_gen_s_per_sample * s["eval_prompts"]
    left_s = budget_s * (1.0 - margin) - spent_s - fixed_s
    per_prompt_s = rates.data_gen_s_per_sample + epochs * rates.train_step_s
    n = max(int(left_s // per_prompt_s), MIN_PROMPTS)
    steps = max(int(round(epochs * n)), 1)
    data_gen_s = rates.load_s + rates.data_gen_s_per_sample * (n + s["eval_prompts"])
    train_s = rates.train_fixed_s + rates.train_step_s * steps
    total_s = spent_s + data_gen_s + train_s + eval_s
    return {"n_prompts": n, "train_steps": steps, "epochs": round(epochs, 3), "budget_s": round(budget_s, 1),
            "estimate_s": {"spent": round(spent_s, 1), "data_gen": round(data_gen_s, 1), "train": round(train_s, 1),
                           "eval": round(eval_s, 1), "total": round(total_s, 1)},
            "fits": total_s <= budget_s, "rates": {k: round(v, 4) for k, v in vars(rates).items()}}


MAX_EPOCHS = 4  # the most passes over the data a re-sized training makes


def resize_training(plan: dict, budget_s: float, elapsed_s: float, margin: float = 0.08) -> dict:
    """The plan's training steps re-sized to what is left of `budget_s` once data-gen has run (pure).

    Data-gen's real time replaces its estimate, the least certain of the plan: the calibration's one batch measured
    1.6 and 1.0 s/sample in two runs on one idle 2-core Xeon where the whole data-gen then took 0.98 and 0.88
    (2026-12-05), and the second demo overran its 20 minutes. Steps stay between one and MAX_EPOCHS epochs over
    the planned prompts (or the plan's own steps, if fewer); below one epoch the head would not see its data, so
    the plan then says it overruns."""
    r, e, n = plan["rates"], dict(plan["estimate_s"]), plan["n_prompts"]
    left_s = budget_s * (1.0 - margin) - elapsed_s - e["eval"] - r["train_fixed_s"]
    planned = plan.get("resized", {}).get("planned_steps", plan["train_steps"])
    steps = int(min(max(left_s / r["train_step_s"], min(n, planned)), MAX_EPOCHS * n))
    e["train"] = round(r["train_fixed_s"] + r["train_step_s"] * steps, 1)
    e["total"] = round(elapsed_s + e["train"] + e["eval"], 1)
    return {"train_steps": steps, "estimate_s": e, "fits": e["total"] <= budget_s,
            "resized": {"data_gen_end_s": round(elapsed_s, 1),
                        "data_gen_end_estimate_s": round(e["spent"] + e["data_gen"], 1),
                        "planned_steps": planned, "epochs": round(steps / n, 3)}}


def resized_text(plan: dict) -> str:
    """The line the demo prints when it re-sizes the training."""
    z = plan["resized"]
    text = (f"demo: data-gen ended at {z['data_gen_end_s'] / 60:.1f} min (planned {z['data_gen_end_estimate_s'] / 60:.1f}); "
            f"training re-sized from {z['planned_steps']} to {plan['train_steps']} steps ({z['epochs']:g} epochs), "
            f"estimated end {plan['estimate_s']['total'] / 60:.1f} min")
    if not plan["fits"]:
        text += f": over the {plan['budget_s'] / 60:g}-minute budget even with one epoch"
    return text + "."


def plan_text(plan: dict) -> str:
    """The plan as the lines the demo prints before its long stages."""
    r, e = plan["rates"], plan["estimate_s"]
    lines = [f"demo plan for {plan['budget_s'] / 60:.0f} min on this machine: {plan['n_prompts']} training prompts, "
             f"{plan['train_steps']} steps ({plan['epochs']:g} epochs); estimated data-gen {e['data_gen'] / 60:.1f} min, "
             f"train {e['train'] / 60:.1f} min, eval {e['eval'] / 60:.1f} min, total {e['total'] / 60:.1f} min "
             f"(calibration included)",
             f"  measured: data-gen {r['data_gen_s_per_sample']:.2f} s/sample, training {r['train_step_s']:.3f} s/step, "
             f"eval {r['eval_s_per_token'] * 1000:.0f} ms per answer token (every decoder), "
             f"target load {r['load_s']:.1f} s"]
    if not plan["fits"]:
        lines.append(f"  warning: even {plan['n_prompts']} prompts (the least that trains a useful head) overrun the "
                     f"budget on this machine; pass budget_min= or smaller sizes (n_prompts=, train_steps=).")
    return "\n".join(lines)


def plan_key(cfg, s: dict) -> dict:
    """What a saved plan was made for: a rerun with the same key reuses it."""
    return {"sizes": s, "budget_min": cfg.budget_min, "seed": cfg.seed,
            "num_speculative_tokens": cfg.num_speculative_tokens}


def budget_plan(cfg, s: dict, out: Path, t_start: float) -> dict:
    """Calibrate (or reuse the plan a previous run of these settings saved), then size the demo to the budget."""
    key = plan_key(cfg, s)
    try:
        saved = json.loads((out / PLAN).read_text())
    except (OSError, ValueError):
        saved = None
    if isinstance(saved, dict) and saved.get("key") == json.loads(json.dumps(key)):
        plan = dict(saved["plan"], calibrated_now=False)
        print(f"demo plan reused from {out / PLAN}: {plan['n_prompts']} prompts, {plan['train_steps']} steps.",
              file=sys.stderr)
        return plan
    cs = calibration_sizes(s)
    calib_out = out / "calibration"
    print(f"demo: calibrating on this machine ({cs['n_prompts']} prompts, {cs['train_steps']} steps, one short eval) "
          f"to size the demo to {cfg.budget_min:g} min...", file=sys.stderr)
    calib = run_stages(cfg, cs, calib_out)
    t0 = time.perf_counter()
    load_target(compose("data_gen", stage_overrides(cfg, cs, calib_out)["data_gen"]).target)
    load_s = time.perf_counter() - t0
    rates = measured_rates(calib, calib_out, cs, load_s)
    spent_s = time.perf_counter() - t_start
    plan = dict(plan_sizes(s, cfg.budget_min * 60.0, spent_s, rates), calibration_s=round(spent_s, 1))
    atomic_write_json(out / PLAN, {"key": key, "plan": plan})
    print(plan_text(plan), file=sys.stderr)
    return dict(plan, calibrated_now=True)


def builtin_summary(report: dict) -> list[str]:
    """The built-in decoder's drafters side by side (the measured method and each drafting baseline: the head alone,
    n-gram lookup, n-gram + head), and which one wins."""
    rows = {report["method"]: report} | {name: b for name, b in (report.get("baselines") or {}).items()
                                        if b.get("tau") is not None}
    if len(rows) < 2:
        return []
    best = max(rows, key=lambda n: rows[n]["speedup"])
    verdict = (f"{best} wins" if rows[best]["speedup"] > 1.0 else
               f"none is faster than target-only; {best} is the least slow")
    cells = ", ".join(f"{name} tau {row['tau']:.2f} {row['speedup']:.2f}x" for name, row in rows.items())
    return [f"  built-in decoder, side by side: {cells}: {verdict}"]


def llamacpp_summary(report: dict, target: str) -> list[str]:
    """llama.cpp's speedups of the head, n-gram and head + n-gram, and which one wins; how to get it when missing."""
    e = report.get("llamacpp")
    if not e:
        if target != "smollm2":
            return []
        return [f"  llama.cpp: not measured ({llamacpp.llamacpp_missing() or 'eval ran without engine=llamacpp'}); "
                f"`{llamacpp.BUILD}` builds it, and the next demo run measures the head there too"]
    runs = e["runs"]
    # speedups only: llama.cpp's tau counts only the steps that had a draft, which flatters n-gram lookup
    cells = ", ".join(f"{name} {r['speedup']:.2f}x" for name, r in runs.items())
    # the winner eval named (eval/engine_llamacpp.py `fastest`, not imported: it would bring torch to the CLI); a
    # rerun that skips eval reads its earlier report.json, and one written before 2026-12-06 (a5d4569) names none
    best = e["fastest"] if "fastest" in e else max(runs, key=lambda n: runs[n]["speedup"])
    verdict = (f"{best} wins" if runs[best]["speedup"] > 1.0 else
               f"none is faster than target-only; {best} is the least slow")
    head_tau = f", head tau {e['tau']:.2f}" if e.get("tau") is not None else ""
    return [f"  llama.cpp ({Path(e['target']).name}, {e['target_only_tokens_per_s']:.1f} tokens/s target-only"
            f"{head_tau}): {cells}: {verdict}"]


def summary(result: dict) -> str:
    """The few lines the demo ends with (the CLI prints them): tau, per-position acceptance, speedup, the report."""
    r = result["report"]
    acc = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
    lines = [
        f"draftsmith demo ({result['flavour']}): EAGLE-3 head on {r['target']['target_id']}, "
        f"{r['n_prompts']} held-out prompts, temperature {r['temperature']}, chain K={r['drafting']['num_speculative_tokens']}",
        f"  tau (tokens per target verification, bonus included): {r['tau']:.2f}",
        f"  per-position acceptance: {acc}",
        f"  speedup: {r['speedup']:.2f}x ({r['speculative_tokens_per_s']:.1f} vs {r['target_only_tokens_per_s']:.1f} "
        f"tokens/s target-only, same decoder)",
    ]
    lines += builtin_summary(r)
    lines += llamacpp_summary(r, result["sizes"]["target"])
    if result.get("plan"):
        p = result["plan"]
        resized = f", re-sized from {p['resized']['planned_steps']} after data-gen" if p.get("resized") else ""
        lines.append(f"  sized to {p['budget_s'] / 60:.0f} min: {p['n_prompts']} training prompts, {p['train_steps']} steps"
                     f"{resized} (estimated {p['estimate_s']['total'] / 60:.1f} min; plan in {Path(result['out']) / PLAN})")
    secs = ", ".join(f"{k} {v:.0f} s" for k, v in result["seconds"].items())
    skipped = f" (skipped, already complete: {', '.join(result['skipped'])})" if result["skipped"] else ""
    lines.append(f"  time: {secs}{skipped}")
    lines.append(f"  report: {Path(result['out']) / 'eval' / 'report.md'}")
    return "\n".join(lines)
