"""Benchmark: EAGLE-3 head quality at an equal training budget, draftsmith beside its peers (not a test).

    python benchmarks/bench_vs_peers.py --data runs/demo/data --out runs/vs_peers --budget-s 240 \
        [--holdout 16] [--spec-bench-n 16] [--ks 3 7] [--engine vllm] [--peers speculators] \
        [--variant ttt3:method.ttt_steps=3 --variant nodecay:method.ttt_decay=1.0 ...]

One data-gen output of the embedded target (self-written prompts, hidden states) feeds every trainer:
  held-out       its last `--holdout` rows are never trained on (draftsmith: val_samples; the peers get the
                 rows before them); a second held-out set is `--spec-bench-n` Spec-Bench questions (at most 2
                 per category), which no data-gen ever saw
  draftsmith     `draftsmith train method=eagle3` offline, its defaults (and each `--variant`'s overrides): a
                 short calibration run measures seconds per step, then as many steps as fit in `--budget-s`
                 (its cosine schedule ends on the budget)
  speculators    vLLM's speculators 0.9 EAGLE-3 trainer on the same rows, converted to its format, on CPU with the
                 documented patches of benchmarks/peers/speculators_eagle3.py, its own recipe's defaults, for the
                 same wall-clock; its head converted to a folder draftsmith evaluates (peer not installed: said)
  SpecForge      ../shared/peers/specforge_step.py times one OnlineEagle3Model step; a full SpecForge training
                 run on CPU is not built here, so it has no head to evaluate (said in the table)
Every head is evaluated by `draftsmith eval` on both held-out sets at T = 0, chain, each K of `--ks` (fp32):
the built-in decoder, and vLLM for CPU with `--engine vllm` (its τ is the one that counts). Prints per head,
set and K the τ (and the ratio draftsmith / peer), and writes `<out>/bench_vs_peers.json` with the machine.

Resumable: a stage whose `<folder>/done.json` holds the same overrides is not run again. Run it alone: two
processes on these cores make torch's threads spin and the budgets stop being equal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from draftsmith.artifacts import atomic_write_json
from draftsmith.configs import compose
from draftsmith.eval.run import run as eval_run
from draftsmith.machine import machine_info
from draftsmith.train.run import run as train_run

ROOT = Path(__file__).resolve().parents[1]
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench_question.jsonl"
PEER_SPECULATORS = ROOT / "benchmarks" / "peers" / "speculators_eagle3.py"


def done_or_run(folder: Path, overrides: list[str], fn) -> dict:
    """fn() unless folder/done.json holds these overrides (then its recorded result)."""
    stamp = folder / "done.json"
    if stamp.is_file():
        rec = json.loads(stamp.read_text())
        if rec.get("overrides") == overrides:
            return rec["result"]
    t0 = time.perf_counter()
    result = fn()
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(stamp, {"overrides": overrides, "result": result, "seconds": round(time.perf_counter() - t0, 1)})
    return result


def n_rows(data: Path) -> int:
    return int(json.loads((data / "manifest.json").read_text())["counts"]["samples"])


# --------------------------------------------------------------------------- draftsmith

def draftsmith_overrides(args, out: Path, steps: int, extra: list[str]) -> list[str]:
    return ["method=eagle3", "target=smollm2", f"data={args.data}", f"out={out}", f"max_steps={steps}", "mode=offline",
            f"val_samples={args.holdout}", f"micro_batch_size={args.micro_batch_size}", f"max_length={args.max_length}",
            f"lr={args.lr}", f"method.draft_vocab_size={args.draft_vocab_size}", f"seed={args.seed}",
            "precision=fp32", "deepspeed=none", "progress=false", "wandb.mode=disabled", "overwrite=true",
            "save_every=100000", *extra]


def mean_step_s(out: Path, skip: int) -> float:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step_s" in r][skip:]
    return sum(r["step_s"] for r in rows) / len(rows)


def train_draftsmith(args, name: str, extra: list[str]) -> dict:
    """Calibrate seconds per step, then train for as many steps as fit in the budget."""
    calib = args.out / name / "calibration"
    train_run(compose("train", draftsmith_overrides(args, calib, args.calib_steps, extra)))
    s_per_step = mean_step_s(calib, skip=2)
    steps = max(1, int(args.budget_s / s_per_step))
    out = args.out / name / "train"
    t0 = time.perf_counter()
    result = train_run(compose("train", draftsmith_overrides(args, out, steps, extra)))
    wall = time.perf_counter() - t0
    print(f"[{name}] {steps} steps ({s_per_step:.3f} s/step calibrated) in {wall:.0f} s", flush=True)
    return {"head": str(result["final"]), "steps": steps, "samples_seen": steps * args.micro_batch_size,
            "train_wall_s": round(wall, 1), "train_step_s": round(mean_step_s(out, skip=0), 4),
            "calibrated_s_per_step": round(s_per_step, 4), "overrides": extra}


# --------------------------------------------------------------------------- peers

def peer_train(args, out: Path, extra: list[str], passthrough: list[str]) -> dict:
    """One run of benchmarks/peers/speculators_eagle3.py train; its record."""
    rec = out / "peer.json"
    cmd = [sys.executable, str(PEER_SPECULATORS), "train", "--data", str(args.data), "--out", str(out),
           "--samples", str(n_rows(args.data) - args.holdout), "--val-samples", "1",
           "--draft-vocab-size", str(args.draft_vocab_size), "--total-seq-len", str(args.peer_total_seq_len),
           "--seed", str(args.seed), "--precision", "fp32", "--json", str(rec), *extra]
    if passthrough:
        cmd += ["--", *passthrough]
    print("[speculators]", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(rec.read_text())


def train_speculators(args) -> dict:
    """speculators' EAGLE-3 trainer, its recipe's defaults, on the rows draftsmith trains on: a calibration run
    measures its seconds per step, then its LR schedule is set to end on the budget (as draftsmith's) and the
    budget stops it. Its validation row is the first held-out row (never trained on)."""
    calib = peer_train(args, args.out / "speculators" / "calibration", ["--max-steps", str(args.peer_calib_steps)], [])
    s_per_step = calib["train_wall_s"] / max(calib["steps"], 1)
    steps = max(1, int(args.budget_s / s_per_step))
    peer = peer_train(args, args.out / "speculators" / "run", ["--budget-s", str(args.budget_s)],
                      ["--scheduler-total-steps", str(steps)])
    print(f"[speculators] {peer.get('steps')} steps ({s_per_step:.2f} s/step calibrated, schedule {steps} steps), "
          f"{peer.get('samples_seen')} samples in {peer.get('train_wall_s')} s", flush=True)
    return {"head": str(args.out / "speculators" / "run" / "head"), "steps": peer.get("steps"),
            "samples_seen": peer.get("samples_seen"), "train_wall_s": peer.get("train_wall_s"),
            "calibrated_s_per_step": round(s_per_step, 3), "schedule_steps": steps, "record": peer}


def speculators_missing() -> str | None:
    try:
        import speculators  # noqa: F401
    except ImportError as e:
        return f"peer not installed (speculators: {e})"
    if not PEER_SPECULATORS.is_file():
        return f"peer runner missing ({PEER_SPECULATORS})"
    return None


# --------------------------------------------------------------------------- evaluation

def eval_sets(args) -> dict[str, list[str]]:
    return {"self": ["prompts.source=holdout", f"prompts.path={args.data}", f"prompts.holdout={args.holdout}",
                     "prompts.n=null"],
            "spec_bench": ["prompts.source=question", f"prompts.path={args.spec_bench}", "prompts.per_category=2",
                           f"prompts.n={args.spec_bench_n}"]}


def evaluate(args, name: str, head: str, engine: str) -> dict:
    """τ per set and K: the built-in decoder's and (engine=vllm) vLLM's. A speculators head is evaluated through
    the peer script, which registers its head type (EAGLE-3 with the EAGLE-3.1 norms) in draftsmith's table."""
    out = {}
    for set_name, prompt_args in eval_sets(args).items():
        overrides = ["target=smollm2", "target.dtype=float32", f"head={head}", *prompt_args, "temperature=0",
                     "drafting.mode=chain", f"drafting.num_speculative_tokens={args.ks[0]}",
                     f"sweep_k=[{','.join(map(str, args.ks))}]", f"max_new_tokens={args.max_new_tokens}",
                     "repeats=1", "baselines=[]", f"engine={engine}", "progress=false", "plot=false",
                     f"out={args.out / name / f'eval_{set_name}'}", "overwrite=true"]
        if name == "speculators":
            subprocess.run([sys.executable, str(PEER_SPECULATORS), "eval", "--head", head, *overrides], check=True)
            report = json.loads((args.out / name / f"eval_{set_name}" / "report.json").read_text())
        else:
            report = eval_run(compose("eval", overrides))
        out[set_name] = per_k(report, args.ks)
    return out


def per_k(report: dict, ks: list[int]) -> dict:
    """{K: τ and per-position acceptance, built-in and vLLM} from one eval report with a K sweep."""
    sweep = {row["k"]: row for row in report.get("k_sweep", [])}
    method = report["method"]
    engine_runs = (report.get("engine") or {}).get("runs", {})
    rows = {}
    for k in ks:
        row = sweep.get(k, {})
        run = next((r for n, r in engine_runs.items()
                    if r.get("k") == k and r.get("loaded") and (n == method or n.startswith(f"{method}@"))), None)
        rows[str(k)] = {"tau_builtin": row.get("tau"), "per_position_builtin": row.get("per_position_acceptance"),
                   "tau_vllm": run["tau"] if run else None,
                   "per_position_vllm": run["per_position_acceptance"] if run else None}
    return rows


# --------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True, help="a SmolLM2 data-gen output with hidden states")
    ap.add_argument("--out", type=Path, default=Path("runs/vs_peers"))
    ap.add_argument("--budget-s", type=float, default=240.0, help="training wall seconds of every trainer")
    ap.add_argument("--calib-steps", type=int, default=8)
    ap.add_argument("--holdout", type=int, default=16, help="last rows of --data: never trained on, evaluated")
    ap.add_argument("--spec-bench", type=Path, default=SPEC_BENCH)
    ap.add_argument("--spec-bench-n", type=int, default=16)
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--engine", choices=["builtin", "vllm"], default="vllm")
    ap.add_argument("--peers", nargs="*", default=["speculators"], choices=["speculators"])
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:override[,override...]: another draftsmith run at the same budget (an ablation)")
    ap.add_argument("--peer-total-seq-len", type=int, default=8192, help="speculators: tokens packed per step "
                    "(its default 8192)")
    ap.add_argument("--peer-calib-steps", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not (args.data / "manifest.json").is_file():
        print(f"--data {args.data}: not a data-gen output (no manifest.json).", file=sys.stderr)
        return 2
    if args.holdout >= n_rows(args.data):
        print(f"--holdout {args.holdout}: {args.data} has only {n_rows(args.data)} rows.", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs: dict[str, dict] = {}
    trainers = [("draftsmith", []), *[(v.split(":", 1)[0], v.split(":", 1)[1].split(",")) for v in args.variant]]
    for name, extra in trainers:
        key = [f"budget_s={args.budget_s}", *extra]
        runs[name] = done_or_run(args.out / name, key, lambda: train_draftsmith(args, name, extra))
    for peer in args.peers:
        missing = speculators_missing()
        if missing:
            runs[peer] = {"missing": missing}
            continue
        runs[peer] = done_or_run(args.out / peer, [f"budget_s={args.budget_s}"], lambda: train_speculators(args))
    runs["specforge"] = {"missing": "no full SpecForge training run on CPU is built here (only its step timing, "
                                    "../shared/peers/specforge_step.py)"}
    for name, run in runs.items():
        if "head" in run:
            # vLLM for draftsmith's head (the figure that counts); built-in for the ablations and the peer's head (its
            # EAGLE-3.1 norms are a head type only the peer script registers)
            engine = args.engine if name == "draftsmith" else "builtin"
            run["tau"] = done_or_run(args.out / name / "eval", [engine, *map(str, args.ks)],
                                     lambda: evaluate(args, name, run["head"], engine))
    result = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "runs": runs,
              "seconds": round(time.perf_counter() - t0, 1), "machine": machine_info()}
    print_table(result, args)
    atomic_write_json(args.out / "bench_vs_peers.json", result)
    print(f"wrote {args.out / 'bench_vs_peers.json'}")
    return 0


def print_table(result: dict, args) -> None:
    ours = result["runs"]["draftsmith"].get("tau", {})
    print(f"\nT = 0, chain, fp32; training budget {args.budget_s:.0f} s each; held-out: {args.holdout} self-written, "
          f"{args.spec_bench_n} Spec-Bench; {result['machine'].get('cpu', {}).get('model', '?')}")
    print(f"{'head':<14} {'steps':>6} {'samples':>7} {'set':<10} {'K':>2} {'tau built-in':>12} {'tau vLLM':>9} "
          f"{'draftsmith / this (built-in)':>28}")
    for name, run in result["runs"].items():
        if "missing" in run:
            print(f"{name:<14} {run['missing']}")
            continue
        for set_name, per in (run.get("tau") or {}).items():
            for k, t in per.items():
                mine = (ours.get(set_name) or {}).get(k) or {}
                # like with like: the built-in decoder's τ on both sides (only draftsmith's own head also runs in
                # vLLM; the two agree to ~0.01 there)
                ref, base = t.get("tau_builtin"), mine.get("tau_builtin")
                ratio = f"{base / ref:.3f}" if base and ref and name != "draftsmith" else "-"
                print(f"{name:<14} {run.get('steps', '-'):>6} {run.get('samples_seen', '-'):>7} {set_name:<10} {k:>2} "
                      f"{t.get('tau_builtin') or float('nan'):12.3f} {t.get('tau_vllm') or float('nan'):9.3f} "
                      f"{ratio:>28}")


if __name__ == "__main__":
    sys.exit(main())
