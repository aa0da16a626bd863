"""Benchmark: EAGLE-3 vs P-EAGLE vs DFlash at an equal training budget, measured in vLLM and the built-in decoder.

    python benchmarks/bench_methods.py --data runs/demo/data --out runs/bench_methods --budget-s 150 \
        [--methods eagle3 peagle dflash] [--holdout 8] [--sweep-k 1 3 5] [--max-new-tokens 64]

1. For each method, on the same data-gen output (offline: its hidden-state shards) and the same held-out rows
   (`val_samples=--holdout`): a short calibration run (`--calib-steps` steps) measures its seconds per step,
   then it trains for as many steps as fit in `--budget-s` seconds of training (the same wall-clock for every
   method; the steps differ). Same micro-batch, learning rate, precision, max length and draft vocab.
2. Each head is evaluated by `draftsmith eval engine=vllm` on the held-out prompts (`prompts.source=holdout`):
   fp32, greedy, chain, every K of `--sweep-k` in the built-in decoder and in vLLM for CPU (`.venv-vllm`).
3. Print per (method, K) τ and speedup in both engines, the best K of each, and write `<out>/bench_methods.json`
   with the machine beside the figures.

Run it alone: two processes on these cores make torch's threads spin and every figure collapses.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench_engine import per_k_rows

from draftsmith.core.artifacts import atomic_write_json
from draftsmith.configs import compose
from draftsmith.eval.run import run as eval_run
from draftsmith.core.machine import machine_info
from draftsmith.train.run import run as train_run

METHOD_OPTIONS = {"eagle3": [], "peagle": ["method.num_layers=2"], "dflash": ["method.num_layers=2"]}


def train_overrides(method: str, args, out: Path, steps: int) -> list[str]:
    return [f"method={method}", "target=smollm2", f"data={args.data}", f"out={out}", f"max_steps={steps}",
            f"val_samples={args.holdout}", f"micro_batch_size={args.micro_batch_size}", f"lr={args.lr}",
            f"max_length={args.max_length}", f"method.draft_vocab_size={args.draft_vocab_size}", "mode=offline",
            "progress=false", "wandb.mode=disabled", "overwrite=true", *METHOD_OPTIONS[method]]


def seconds_per_step(out: Path, skip: int) -> float:
    """The mean step time of a training run's metrics.jsonl, its first `skip` steps left out (warm-up)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step_s" in r][skip:]
    return sum(r["step_s"] for r in rows) / len(rows)


def train(method: str, args) -> dict:
    calib = args.out / "calibration" / method
    train_run(compose("train", train_overrides(method, args, calib, args.calib_steps)))
    s_per_step = seconds_per_step(calib, skip=2)
    steps = max(1, int(args.budget_s / s_per_step))
    t0 = time.perf_counter()
    result = train_run(compose("train", train_overrides(method, args, args.out / method, steps)))
    wall = time.perf_counter() - t0
    print(f"trained {method}: {steps} steps ({s_per_step:.3f} s/step calibrated) in {wall:.0f} s", flush=True)
    return {"final": result["final"], "steps": steps, "calibrated_s_per_step": s_per_step, "train_wall_s": wall,
            "measured_s_per_step": seconds_per_step(args.out / method, skip=0)}


def evaluate(method: str, head: str, args) -> dict:
    overrides = ["target=smollm2", "target.dtype=float32", f"head={head}", "prompts.source=holdout",
                 f"prompts.path={args.data}", f"prompts.holdout={args.holdout}", "prompts.n=null", "temperature=0",
                 f"drafting.num_speculative_tokens={args.sweep_k[0]}", f"sweep_k=[{','.join(map(str, args.sweep_k))}]",
                 f"max_new_tokens={args.max_new_tokens}", "repeats=1", "baselines=[]", "engine=vllm",
                 f"out={args.out / 'eval' / method}", "overwrite=true", "progress=false", "plot=false"]
    report = eval_run(compose("eval", overrides))
    # e.g. vLLM for CPU's k_norm defect on a DFlash drafter of 2+ layers (heads/dflash_folders.engine_warning)
    return {"rows": per_k_rows(report, report["method"]), "method": report["method"],
            "engine_warnings": (report.get("engine") or {}).get("warnings", [])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a SmolLM2 data-gen output with hidden states (runs/demo/data)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_methods"))
    ap.add_argument("--methods", nargs="+", default=["eagle3", "peagle", "dflash"])
    ap.add_argument("--budget-s", type=float, default=150.0, help="training wall seconds of each method")
    ap.add_argument("--calib-steps", type=int, default=6)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-length", type=int, default=384)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--holdout", type=int, default=8, help="last rows of the data: never trained on, decoded here")
    ap.add_argument("--sweep-k", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    result: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "methods": {}}
    for method in args.methods:
        trained = train(method, args)
        result["methods"][method] = {**trained, **evaluate(method, trained["final"], args)}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"T=0, chain, fp32, {args.holdout} held-out prompts x {args.max_new_tokens} tokens; training budget "
          f"{args.budget_s:.0f} s each")
    print(f"{'method':<7} {'steps':>5} {'K':>2} {'tau built-in':>12} {'tau vLLM':>9} {'speedup built-in':>16} "
          f"{'speedup vLLM':>12}")
    for method, m in result["methods"].items():
        for r in m["rows"]:
            print(f"{method:<7} {m['steps']:>5} {r['k']:>2} {r['tau_builtin'] or float('nan'):12.3f} "
                  f"{r['tau_vllm']:9.3f} {r['builtin_speedup'] or float('nan'):15.2f}x {r['vllm_speedup']:11.2f}x")
        for engine in ("builtin", "vllm"):
            rows = [r for r in m["rows"] if r[f"{engine}_speedup"] is not None]
            if rows:
                best = max(rows, key=lambda r: r[f"{engine}_speedup"])
                m[f"best_{engine}"] = {"k": best["k"], "speedup": best[f"{engine}_speedup"],
                                       "tau": best["tau_builtin" if engine == "builtin" else "tau_vllm"]}
        print(f"{method:<7} best K: built-in {m.get('best_builtin')}, vLLM {m.get('best_vllm')}")
        for w in m.get("engine_warnings", []):
            print(f"{method:<7} vLLM warning: {w}")
    result["machine"] = machine_info()
    atomic_write_json(args.out / "bench_methods.json", result)
    print(f"wrote {args.out / 'bench_methods.json'} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
