"""Benchmark: which training choices buy the most held-out acceptance per minute of training (not a test).

    nice python benchmarks/bench_sample_efficiency.py --data runs/curve/plain/data --out runs/efficiency \\
        --budget-s 180 --val-samples 40 [--configs base lr_3e-4 lr_3e-3 constant_lr vocab_32000 online batch_4]

Every config trains an EAGLE-3 head on the same data (its last --val-samples rows held out) for the same
training time on the same machine: a probe of --probe-steps steps measures the config's step time, and the
run gets max_steps = budget / step time, so its learning-rate schedule ends inside the budget. The held-out
rows are evaluated four times along the run; the figures are those of the end: etau_greedy (E[tau] of a chain
as long as the TTT depth, T=0, from the TTT unroll's per-anchor agreement: no decoding), etau_sample, acc_0 and
outside_draft (share of held-out positions whose target argmax is outside the draft vocab), beside the run's
steps, its measured training seconds (the sum of step_s: held-out evaluations excluded), step time and the
epochs it saw. Configs (overrides of `draftsmith train` on top of `base`):

    base         offline, bf16, lr 1e-3 cosine to 0 after 5 % warm-up, draft vocab 8192, micro-batch 1, TTT 7
    lr_3e-4      lr=3e-4                    lr_3e-3      lr=3e-3
    constant_lr  min_lr_ratio=1 (constant after warm-up)
    vocab_32000  method.draft_vocab_size=32000
    online       mode=online (the target runs in every step instead of reading captured features)
    batch_4      micro_batch_size=4 (length-bucketed, right-padded; same lr)

Each config's folder is `<out>/<config>/`; a finished config is kept when rerun with the same command (its
`done.json` holds the overrides and step count), so the script is resumable. Writes
`<out>/sample_efficiency.json` and `<out>/sample_efficiency.md`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from draftsmith.core.artifacts import atomic_write_bytes, atomic_write_json
from draftsmith.core.machine import machine_info

CONFIGS = {
    "base": [],
    "lr_3e-4": ["lr=3e-4"],
    "lr_3e-3": ["lr=3e-3"],
    "constant_lr": ["min_lr_ratio=1.0"],
    "vocab_32000": ["method.draft_vocab_size=32000"],
    "online": ["mode=online"],
    "batch_4": ["micro_batch_size=4"],
}


def base_overrides(args, out: Path) -> list[str]:
    return ["method=eagle3", f"target={args.target}", f"data={args.data}", f"out={out}", "mode=offline",
            "deepspeed=none", "lr=1e-3", "warmup_ratio=0.05", "method.draft_vocab_size=8192",
            f"max_length={args.max_length}", "precision=bf16", f"seed={args.seed}", f"val_samples={args.val_samples}",
            "wandb.mode=disabled", "progress=false", "save_every=100000", "overwrite=true"]


def train(overrides: list[str]) -> list[dict]:
    """Run `draftsmith train` in this process; its metrics.jsonl records."""
    from draftsmith.configs import compose
    from draftsmith.train.run import run

    run(compose("train", overrides))
    out = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("out=")))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def measure(args, name: str) -> dict:
    folder = args.out / name
    done = folder / "done.json"
    extra = CONFIGS[name]
    if done.is_file() and json.loads(done.read_text()).get("extra") == extra + [f"budget_s={args.budget_s}"]:
        return json.loads(done.read_text())["row"]
    print(f"sample efficiency: {name}: probe", file=sys.stderr, flush=True)
    probe = train(base_overrides(args, folder / "probe") + extra + [f"max_steps={args.probe_steps}"])
    step_s = statistics.median(r["step_s"] for r in probe if "step_s" in r and r["step"] > 2)
    steps = max(4, int(args.budget_s / step_s))
    print(f"sample efficiency: {name}: {steps} steps at {step_s:.3f} s", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    records = train(base_overrides(args, folder / "head") + extra + [f"max_steps={steps}",
                                                                     f"eval_every={max(1, steps // 4)}"])
    wall = time.perf_counter() - t0
    steps_rec = [r for r in records if "step_s" in r]
    evals = [r for r in records if "val_etau_greedy" in r]
    last = evals[-1]
    samples = sum(1 for _ in _rows(args)) - args.val_samples
    batch = 4 if "micro_batch_size=4" in extra else 1
    row = {"config": name, "overrides": extra, "steps": steps, "probe_step_s": round(step_s, 4),
           "train_s": round(sum(r["step_s"] for r in steps_rec), 1), "wall_s": round(wall, 1),
           "epochs": round(steps * batch / samples, 2),
           "val_etau_greedy": last["val_etau_greedy"], "val_etau_sample": last["val_etau_sample"],
           "val_acc_0": last["val_acc_0"], "val_outside_draft": last["val_outside_draft"],
           "curve": [{"step": r["step"], "train_s": round(sum(s["step_s"] for s in steps_rec if s["step"] <= r["step"]), 1),
                      "val_etau_greedy": r["val_etau_greedy"], "val_acc_0": r["val_acc_0"]} for r in evals]}
    atomic_write_json(done, {"extra": extra + [f"budget_s={args.budget_s}"], "row": row})
    return row


def _rows(args):
    from datasets import load_from_disk

    return load_from_disk(str(Path(args.data) / "tokenized"))


def table(rows: list[dict]) -> str:
    lines = ["| config | steps | train s | step s | epochs | held-out E[tau] greedy (K=7) | E[tau] sample | acc_0 "
             "| outside draft |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['steps']} | {r['train_s']:.0f} | {r['probe_step_s']:.3f} | {r['epochs']} | "
                     f"{r['val_etau_greedy']:.3f} | {r['val_etau_sample']:.3f} | {r['val_acc_0']:.3f} | "
                     f"{r['val_outside_draft']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a data-gen output folder with hidden states")
    ap.add_argument("--out", type=Path, default=Path("runs/efficiency"))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--budget-s", type=float, default=180.0, help="training seconds per config")
    ap.add_argument("--val-samples", type=int, default=40)
    ap.add_argument("--probe-steps", type=int, default=8)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--max-length", type=int, default=384)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not (Path(args.data) / "hidden_states" / "index.json").is_file():
        print(f"--data {args.data}: no hidden_states/ (data-gen hidden_states=true): offline configs need it.",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.configs:
        rows.append(measure(args, name))
        atomic_write_json(args.out / "sample_efficiency.json", {
            "machine": machine_info(), "data": str(args.data), "budget_s": args.budget_s, "val_samples": args.val_samples, "rows": rows})
        atomic_write_bytes(args.out / "sample_efficiency.md", (table(rows) + "\n").encode())
    print(table(rows))
    print(f"-> {args.out / 'sample_efficiency.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
