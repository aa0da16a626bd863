"""Benchmark of draft-model distillation on the embedded SmolLM2 (not a test).

    python benchmarks/bench_draft.py --data runs/smol --out bench_draft.json [--layers 4] [--steps 40] [--mode offline]
        [--losses fkl rkl jsd tv ce] [--holdout 6] [--max-new-tokens 48] [--temperatures 0 1]

1. `before`: a draft of --layers of SmolLM2's 30 layers (spread from first to last; the target's
   embeddings, final norm and lm_head), saved as an HF folder without training.
2. For every loss: `draftsmith train method=draft method.loss=<loss>` (--mode: online, or offline from
   the data's top-k cache written by `data-gen ... topk_logits=true`), the same --steps,
   learning rate and data (the data-gen folder's last --holdout conversations held out).
3. `draftsmith eval` of each folder on those held-out prompts (all trainings first, then the evals):
   `before` at every --temperatures, every loss at --table-temperatures (tau, our decoder's tokens/s),
   then the best loss at every --temperatures; `before` and the best with
   transformers' assisted generation (`baselines=[hf_assisted]`) with the same draft folder beside
   our decoder, in one eval run each.
Prints the tables and writes every figure (and each eval's report) to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from draftsmith.core.machine import machine_info
from draftsmith.configs import compose
from draftsmith.core.artifacts import atomic_write_json


def eval_row(head: str, data: str, out: Path, temperature: float, args, assisted: bool) -> dict:
    from draftsmith.eval.run import run as run_eval

    overrides = [f"target={args.target}", f"head={head}", "prompts.source=holdout", f"prompts.path={data}",
                 f"prompts.holdout={args.holdout}", f"prompts.n={args.eval_prompts}", f"max_new_tokens={args.max_new_tokens}",
                 f"temperature={temperature}", f"drafting.num_speculative_tokens={args.k}", f"repeats={args.repeats}",
                 "progress=false", "plot=false", f"out={out}", "overwrite=true"]
    if assisted:
        overrides.append("baselines=[hf_assisted]")
    done = out / "report.json"  # a rerun with the same --work keeps what an earlier run finished
    report = json.loads(done.read_text()) if done.is_file() else run_eval(compose("eval", overrides))
    row = {"temperature": temperature, "tau": report["tau"], "ours_tokens_per_s": report["speculative_tokens_per_s"],
           "target_only_tokens_per_s": report["target_only_tokens_per_s"], "speedup": report["speedup"],
           "per_position_acceptance": report["per_position_acceptance"]}
    if assisted:
        hf = report["baselines"]["hf_assisted"]["tokens_per_s"]
        row.update(hf_assisted_tokens_per_s=hf, ours_over_hf_assisted=report["speculative_tokens_per_s"] / hf)
    return row


def train(loss: str, data: str, out: Path, args) -> dict:
    from draftsmith.train.run import run as run_train

    cfg = compose("train", [f"target={args.target}", "method=draft", f"method.num_layers={args.layers}",
                            f"method.loss={loss}", f"data={data}", f"out={out}", f"mode={args.mode}", "deepspeed=none",
                            f"max_steps={args.steps}", f"lr={args.lr}", "warmup_ratio=0.05", "min_lr_ratio=0.1",
                            f"micro_batch_size={args.micro_batch_size}", f"val_samples={args.holdout}",
                            f"max_length={args.max_length}", f"save_every={args.steps}", "keep_last=1",
                            "progress=false", "wandb.mode=disabled", "overwrite=true"])
    t0 = time.perf_counter()
    if (out / "final" / "config.json").is_file():  # finished by an earlier run with the same --work
        last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        val = json.loads((out / "val_metrics.json").read_text()) if (out / "val_metrics.json").is_file() else {}
        result = {"final": str(out / "final"), "metrics": last, "val": val}
    else:
        result = run_train(cfg)
    return {"seconds": round(time.perf_counter() - t0, 1), "final": result["final"],
            "last_step": {k: v for k, v in result["metrics"].items() if k.startswith(("loss", "acc", "alpha"))},
            "val": result["val"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a data-gen output of the target (e.g. prompts=self)")
    ap.add_argument("--out", default="bench_draft.json")
    ap.add_argument("--work", default=None, help="folder for the drafts and eval reports (default: a temp folder)")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--losses", nargs="+", default=["fkl", "rkl", "jsd", "tv", "ce"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--mode", default="auto", help="online (the target in the process) | offline (the data's top-k "
                    "cache: data-gen topk_logits=true) | auto")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=384)
    ap.add_argument("--holdout", type=int, default=6, help="the data's last conversations, held out of training")
    ap.add_argument("--eval-prompts", type=int, default=None, help="eval a sample of that many held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens of our decoder")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0],
                    help="before vs the best loss, ours vs transformers' assisted generation")
    ap.add_argument("--table-temperatures", type=float, nargs="+", default=[0.0], help="the per-loss tau table")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_draft."))
    t_start = time.perf_counter()

    from draftsmith.data_gen.target import TargetConfig, load_target
    from draftsmith.heads.draft import draft_from_target, pick_layers
    from draftsmith.heads.draft_folders import save_draft

    target = load_target(TargetConfig(name=args.target, dtype="float32"))
    layers = pick_layers(target.num_layers, args.layers, "spread")
    before = str(work / "before")
    if not (work / "before" / "config.json").is_file():
        save_draft(draft_from_target(target, layers, None, False), before, target.identity())
    del target
    result = {"settings": vars(args) | {"layers_copied": layers}, "trained": {}, "eval": {}}

    def evaluate(name: str, head: str, assisted: bool, temperatures: list[float]) -> None:
        result["eval"][name] = [eval_row(head, args.data, work / f"eval_{name}_T{t:g}", t, args, assisted)
                                for t in temperatures]
        for r in result["eval"][name]:
            print(f"{name:>8} T={r['temperature']:g}: tau {r['tau']:.3f}, ours {r['ours_tokens_per_s']:.1f} tok/s"
                  + (f", hf_assisted {r['hf_assisted_tokens_per_s']:.1f} tok/s (ours x{r['ours_over_hf_assisted']:.2f})"
                     if "hf_assisted_tokens_per_s" in r else ""), file=sys.stderr, flush=True)
        result["machine"] = machine_info()  # CPU kind, vector features, bf16, threads: beside every figure
        atomic_write_json(args.out, result)

    for loss in args.losses:
        result["trained"][loss] = train(loss, args.data, work / f"train_{loss}", args)
        print(f"trained {loss} in {result['trained'][loss]['seconds']} s: {result['trained'][loss]['last_step']}, "
              f"held-out {result['trained'][loss]['val']}", file=sys.stderr, flush=True)
        result["machine"] = machine_info()  # CPU kind, vector features, bf16, threads: beside every figure
        atomic_write_json(args.out, result)
    evaluate("before+hf", before, True, args.temperatures)
    for loss in args.losses:
        evaluate(loss, result["trained"][loss]["final"], False, args.table_temperatures)
    t0 = args.table_temperatures[0]
    best = max(args.losses, key=lambda l: next(r["tau"] for r in result["eval"][l] if r["temperature"] == t0))
    evaluate(f"{best}+hf", result["trained"][best]["final"], True, args.temperatures)  # the winner beside hf_assisted
    result["best_loss"] = best
    result["tau_gain_vs_before"] = {
        f"T={t:g}": next(r["tau"] for r in result["eval"][f"{best}+hf"] if r["temperature"] == t)
        / next(r["tau"] for r in result["eval"]["before+hf"] if r["temperature"] == t) - 1 for t in args.temperatures}
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    result["machine"] = machine_info()  # CPU kind, vector features, bf16, threads: beside every figure
    atomic_write_json(args.out, result)

    print("\n| loss | " + " | ".join(f"tau T={t:g}" for t in args.table_temperatures) + " | train s |")
    print("|---|" + "---:|" * (len(args.table_temperatures) + 1))
    for name in ["before+hf", *args.losses]:
        taus = " | ".join(f"{r['tau']:.3f}" for r in result["eval"][name] if r["temperature"] in args.table_temperatures)
        secs = result["trained"][name]["seconds"] if name in result["trained"] else "-"
        print(f"| {name} | {taus} | {secs} |")
    print(f"\nbest loss: {best}; tau gain vs before: "
          + ", ".join(f"{k} {v:+.1%}" for k, v in result["tau_gain_vs_before"].items()))
    for name in ("before+hf", f"{best}+hf"):
        for r in result["eval"][name]:
            print(f"{name} T={r['temperature']:g}: ours {r['ours_tokens_per_s']:.1f} tok/s vs transformers assisted "
                  f"{r['hf_assisted_tokens_per_s']:.1f} tok/s (x{r['ours_over_hf_assisted']:.2f}); "
                  f"target-only {r['target_only_tokens_per_s']:.1f} tok/s")
    print(f"-> {args.out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
