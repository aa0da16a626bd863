"""The same training run with two builds of draftsmith, side by side: step time and held-out E[τ] (not a test).

    # another build installed apart, e.g. the commit before a change:
    git worktree add /tmp/old <commit> && pip install --no-deps --no-build-isolation --target /tmp/oldsite /tmp/old
    python benchmarks/bench_train_builds.py --other /tmp/oldsite --data runs/demo/data --out runs/builds \
        --rounds 2 -- max_steps=600 lr=3e-3 ...

Each round trains once with this checkout's draftsmith and once with the other build (PYTHONPATH=--other), in
alternating order, the same command (the demo's training by default: offline, micro-batch 1, bf16 by `auto`,
TTT 3, draft vocab 8192, warm-up 5 %, val_samples 10), each alone on the machine. Per run: the median `step_s` of
metrics.jsonl after the first 20 steps (the warm-up), wall seconds, and the trainer's held-out `val_etau_greedy`.
The ratio is the other build's median step over this build's (> 1: this build is faster). Prints a table, writes
JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEMO_TRAIN = ["method=eagle3", "target=smollm2", "mode=offline", "deepspeed=none", "lr=3e-3", "warmup_ratio=0.05",
              "method.draft_vocab_size=8192", "max_length=384", "val_samples=10", "precision=auto", "seed=0",
              "wandb.mode=disabled", "progress=false", "save_every=100000"]


def train(build: str, other: Path, data: Path, out: Path, extra: list[str]) -> dict:
    env = dict(os.environ)
    if build == "other":
        env["PYTHONPATH"] = str(other)
    cmd = [sys.executable, "-c", "from draftsmith.cli import main; main()", "train", *DEMO_TRAIN, f"data={data}",
           f"out={out}", *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{build} build's training failed:\n{done.stderr[-2000:]}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_s = [r["step_s"] for r in steps[20:]] or [r["step_s"] for r in steps]
    val = json.loads((out / "val_metrics.json").read_text())
    return {"build": build, "steps": len(steps), "median_step_s": statistics.median(step_s), "wall_s": round(wall, 1),
            "val_etau_greedy": val.get("val_etau_greedy", val.get("etau_greedy")), "val": val}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", type=Path, required=True, help="a folder holding the other build's draftsmith package")
    ap.add_argument("--data", type=Path, required=True, help="a data-gen folder (with hidden states)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("extra", nargs="*", help="more train overrides (after --)")
    args = ap.parse_args()
    from draftsmith.core.machine import machine_info

    runs = []
    for r in range(args.rounds):
        order = ("this", "other") if r % 2 == 0 else ("other", "this")
        for build in order:
            row = train(build, args.other, args.data, args.out / f"round{r}_{build}", args.extra)
            row["round"] = r
            print(json.dumps({k: v for k, v in row.items() if k != "val"}), flush=True)
            runs.append(row)
    this = statistics.median(x["median_step_s"] for x in runs if x["build"] == "this")
    other = statistics.median(x["median_step_s"] for x in runs if x["build"] == "other")
    result = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "other": str(args.other),
              "train_overrides": DEMO_TRAIN + args.extra, "runs": runs,
              "median_step_s": {"this": this, "other": other}, "other_over_this": round(other / this, 3)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_train_builds.json").write_text(json.dumps(result, indent=1))
    print(f"median step: this build {this * 1000:.1f} ms, other {other * 1000:.1f} ms, other/this {other / this:.3f}")
    for x in runs:
        print(f"round {x['round']} {x['build']:5s} step {x['median_step_s'] * 1000:7.1f} ms  wall {x['wall_s']:6.1f} s  "
              f"val E[tau] {x['val_etau_greedy']}")


if __name__ == "__main__":
    main()
