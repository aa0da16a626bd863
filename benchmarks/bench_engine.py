"""Benchmark: the built-in decoder's speedup beside vLLM's, same head, same prompts, one run (not a test).

    python benchmarks/bench_engine.py --head runs/demo/head/final --out runs/bench_engine.json \
        [--per-category 1] [--max-new-tokens 64] [--repeats 2] [--sweep-k 1 3 5] [--k 3]

One `draftsmith eval engine=vllm` on the embedded SmolLM2 (fp32, greedy, chain): the built-in decoder decodes
every prompt target-only and with the head at each K (methods interleaved per prompt), then vLLM for CPU
(`.venv-vllm`, bash scripts/setup.sh --engine) decodes the same token ids target-only and with the head at each
K, one prompt at a time. Per K it prints τ (vLLM's counting on both sides), tokens/s and speedup of each engine,
and the ratio built-in speedup / vLLM speedup (issue 24's goal: within 10 %, i.e. 0.90-1.10). It also prints
the per-cycle costs that explain the gap: the built-in decoder's measured target step, verify pass and draft
step (the cost model's table) beside vLLM's seconds per target-only token and per speculative cycle
(decode seconds / verifications, from its counters).

Run it alone: two processes on these cores make torch's threads spin and every figure collapses.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from draftsmith.core.artifacts import atomic_write_json
from draftsmith.configs import compose
from draftsmith.eval.run import run
from draftsmith.core.machine import machine_info

SPEC_BENCH = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_question.jsonl")


def per_k_rows(report: dict, method: str) -> list[dict]:
    """One row per K: both engines' τ, tokens/s, speedup, and the cycle costs behind them."""
    eng = report["engine"]
    cost = {c["k"]: c for c in (report.get("cost_model") or {}).get("table", [])}
    step_s = ((report.get("cost_model") or {}).get("target") or {}).get("step_s")
    eng_base = eng["target_only_tokens_per_s"]
    builtin_base = report["target_only_tokens_per_s"]
    rows = []
    for name, r in eng["runs"].items():
        if not r.get("loaded") or not (name == method or name.startswith(f"{method}@K=")):
            continue
        k, a = r["k"], r.get("agreement") or {}
        c = cost.get(k, {})
        rows.append({
            "k": k, "tau_builtin": a.get("tau_builtin"), "tau_vllm": r["tau"],
            "steps_identical_fraction": a.get("steps_identical_fraction"), "tau_equal": a.get("equal"),
            "greedy_identical": r["greedy_identical_to_engine_target_only"],
            "builtin_tokens_per_s": builtin_base * r["builtin_speedup"] if r.get("builtin_speedup") else None,
            "builtin_target_only_tokens_per_s": builtin_base, "builtin_speedup": r.get("builtin_speedup"),
            "vllm_tokens_per_s": r["speculative_tokens_per_s"], "vllm_target_only_tokens_per_s": eng_base,
            "vllm_speedup": r["speedup"],
            "ratio": (r["builtin_speedup"] / r["speedup"]) if r.get("builtin_speedup") and r["speedup"] else None,
            "builtin_step_s": step_s, "builtin_verify_s": c.get("t_verify_s"), "builtin_draft_s": c.get("t_draft_s"),
            "vllm_s_per_target_token": 1.0 / eng_base if eng_base else None,
            # vLLM's seconds per speculative cycle: τ tokens per cycle at its tokens/s (prefill included, as in
            # the built-in tokens/s)
            "vllm_s_per_cycle": (r["tau"] / r["speculative_tokens_per_s"]) if r["speculative_tokens_per_s"] else None,
        })
    return sorted(rows, key=lambda row: row["k"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", required=True, help="an EAGLE-3 (or P-EAGLE) folder trained for SmolLM2")
    ap.add_argument("--out", default="runs/bench_engine.json")
    ap.add_argument("--prompts", default=SPEC_BENCH)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--sweep-k", type=int, nargs="+", default=[1, 3, 5])
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = ["target=smollm2", "target.dtype=float32", f"head={args.head}", "prompts=question",
                     f"prompts.path={args.prompts}", f"prompts.per_category={args.per_category}", "prompts.n=null",
                     f"sweep_k=[{','.join(str(k) for k in args.sweep_k)}]", "temperature=0", "drafting.mode=chain",
                     f"drafting.num_speculative_tokens={args.k}", f"max_new_tokens={args.max_new_tokens}",
                     f"repeats={args.repeats}", "baselines=[]", "engine=vllm", "progress=false", "plot=false",
                     f"out={Path(tmp) / 'eval'}"]
        report = run(compose("eval", overrides))
    rows = per_k_rows(report, report["method"])
    result = {"rows": rows, "head": args.head, "method": report["method"], "n_prompts": report["n_prompts"],
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "sweep_k": args.sweep_k,
              "goal": "built-in speedup within 10 % of vLLM's (ratio 0.90-1.10) at every K",
              "meets_goal": all(r["ratio"] is not None and 0.9 <= r["ratio"] <= 1.1 for r in rows),
              "seconds": round(time.perf_counter() - t0, 1), "engine": {k: v for k, v in report["engine"].items()
                                                                      if k not in ("runs",)},
              "report": report, "machine": machine_info()}
    atomic_write_json(args.out, result)  # first: a print error must not lose the figures
    print(f"{report['method']} on {report['n_prompts']} prompts x {args.max_new_tokens} tokens, fp32, greedy, "
          f"repeats {args.repeats}; target-only: built-in {report['target_only_tokens_per_s']:.1f} tok/s, "
          f"vLLM {report['engine']['target_only_tokens_per_s']:.1f} tok/s")
    for r in rows:
        print(f"K={r['k']}: tau built-in {r['tau_builtin']:.3f} vLLM {r['tau_vllm']:.3f} (steps identical "
              f"{r['steps_identical_fraction']}); speedup built-in {r['builtin_speedup']:.2f}x vLLM "
              f"{r['vllm_speedup']:.2f}x, ratio {r['ratio']:.2f}; built-in step {r['builtin_step_s'] * 1000:.1f} ms, "
              f"verify {r['builtin_verify_s'] * 1000:.1f} ms, draft {r['builtin_draft_s'] * 1000:.1f} ms; vLLM "
              f"{r['vllm_s_per_target_token'] * 1000:.1f} ms/token target-only, {r['vllm_s_per_cycle'] * 1000:.1f} "
              f"ms/cycle", flush=True)
    print(f"wrote {args.out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
