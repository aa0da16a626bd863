"""Benchmark of the built-in decoder on the embedded SmolLM2 with Spec-Bench prompts (not a test).

    python benchmarks/bench_eval.py --out bench_eval.json [--head runs/demo/head/final]
        [--per-category 2] [--max-new-tokens 64] [--repeats 1] [--temperatures 0 1] [--modes chain tree]

For every (temperature, drafting mode): target-only decoding and speculative decoding with the
n-gram proposer and, when --head is given, the EAGLE-3 head (n-gram then runs as its baseline row),
on the same sample of spec_bench_question.jsonl (first turns, `--per-category` per category).
Prints tau and speedup per row and writes them (with the full eval reports) to --out.

The K sweep and the cost model (predicted vs measured speedup per K, the recommended serving flags):

    python benchmarks/bench_eval.py --head runs/bench_peagle/eagle3/final --prompts runs/bench_peagle/data \
        --prompts-source holdout --holdout 6 --temperatures 0 --modes chain --sweep-k 1 2 3 5 --k 3 --no-ngram
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from draftsmith.core.machine import machine_info
from draftsmith.configs import compose
from draftsmith.core.artifacts import atomic_write_json
from draftsmith.eval.run import run

SPEC_BENCH = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_question.jsonl")  # ../shared beside the repo


def rows_of(report: dict) -> list[dict]:
    """One row per speculative method in a report: tau, tokens/s, speedup."""
    common = {"temperature": report["temperature"], "mode": report["drafting"]["mode"]}
    rows = [{**common, "method": report["method"], "tau": report["tau"],
             "tokens_per_s": report["speculative_tokens_per_s"],
             "target_only_tokens_per_s": report["target_only_tokens_per_s"], "speedup": report["speedup"]}]
    for name, b in report["baselines"].items():
        rows.append({**common, "method": name, "tau": b["tau"], "tokens_per_s": b["tokens_per_s"],
                     "target_only_tokens_per_s": report["target_only_tokens_per_s"], "speedup": b["speedup"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_eval.json")
    ap.add_argument("--head", default=None, help="an EAGLE-3 folder trained for SmolLM2 (e.g. runs/demo/head/final)")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", default=SPEC_BENCH)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens (chain length / tree depth)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--modes", nargs="+", default=["chain", "tree"])
    ap.add_argument("--prompts-source", default="question", help="question (a Spec-Bench-style JSONL) | holdout (a data-gen folder)")
    ap.add_argument("--holdout", type=int, default=6, help="holdout: the last this-many conversations")
    ap.add_argument("--sweep-k", type=int, nargs="*", default=[], help="also decode the head at these K (cost model)")
    ap.add_argument("--dtype", default="bfloat16", help="target.dtype")
    ap.add_argument("--no-ngram", action="store_true", help="with --head: skip the n-gram baseline row")
    args = ap.parse_args(argv)

    head = args.head or "ngram"
    rows, reports = [], []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for temperature in args.temperatures:
            for mode in args.modes:
                out = Path(tmp) / f"t{temperature}-{mode}"
                if args.prompts_source == "holdout":
                    prompt_args = ["prompts.source=holdout", f"prompts.holdout={args.holdout}"]
                else:
                    prompt_args = ["prompts=question", f"prompts.per_category={args.per_category}"]
                sweep = ",".join(str(k) for k in args.sweep_k)
                overrides = [f"target={args.target}", f"target.dtype={args.dtype}", f"head={head}", *prompt_args,
                             f"prompts.path={args.prompts}", "prompts.n=null", f"sweep_k=[{sweep}]",
                             f"temperature={temperature}", f"drafting.mode={mode}",
                             f"drafting.num_speculative_tokens={args.k}", f"max_new_tokens={args.max_new_tokens}",
                             f"repeats={args.repeats}", "progress=false", "plot=false", f"out={out}"]
                if args.head and not args.no_ngram:
                    overrides.append("baselines=[ngram]")
                report = run(compose("eval", overrides))
                reports.append(report)
                for r in rows_of(report):
                    rows.append(r)
                    print(f"T={r['temperature']:<4} {r['mode']:<5} {r['method']:<7} tau {r['tau']:.2f}  "
                          f"{r['tokens_per_s']:6.1f} tok/s vs {r['target_only_tokens_per_s']:6.1f} target-only  "
                          f"speedup {r['speedup']:.2f}x", flush=True)
                for c in (report.get("cost_model") or {}).get("table", []):
                    meas = "-" if c["measured_speedup"] is None else f"{c['measured_speedup']:.2f}x"
                    print(f"    K={c['k']}: verify/step {c['verify_over_step']:.2f}, t_draft {c['t_draft_s'] * 1000:.1f} ms, "
                          f"tau predicted {c['predicted_tau']:.2f}, speedup predicted {c['predicted_speedup']:.2f}x, "
                          f"measured {meas}", flush=True)
                rec = report.get("recommendation")
                if rec:
                    print(f"    best measured K={rec['k']}: {rec['measured_speedup']:.2f}x; vLLM: {rec['vllm']['command']}",
                          flush=True)
    result = {"rows": rows, "prompts": args.prompts, "per_category": args.per_category,
              "n_prompts": reports[0]["n_prompts"] if reports else 0, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "num_speculative_tokens": args.k, "head": args.head, "sweep_k": args.sweep_k,
              "dtype": args.dtype, "prompts_source": args.prompts_source,
              "seconds": round(time.perf_counter() - t0, 1),
              "software": reports[0]["software"] if reports else {}, "hardware": reports[0]["hardware"] if reports else {},
              "conventions": reports[0]["conventions"] if reports else "", "reports": reports}
    result["machine"] = machine_info()  # CPU kind, vector features, bf16, threads: beside every figure
    atomic_write_json(args.out, result)
    print(f"wrote {args.out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
