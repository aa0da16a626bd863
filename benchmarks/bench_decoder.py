"""Benchmark the built-in decoder on SmolLM2: target-only tokens/s vs transformers' greedy `generate` at the
same dtype (side by side, interleaved, one run), per dtype; the target's verify(k) / step cost ratio (the cost
model's input); optionally n-gram speculative tau / speedup. Warm-up excluded, median of repeats. Prints, writes JSON.

    python benchmarks/bench_decoder.py --dtypes float32 bfloat16 --max-new-tokens 48 --repeats 3 --out bench_decoder.json
    python benchmarks/bench_decoder.py --device cuda --dtypes bfloat16     # CUDA: target passes replayed from CUDA graphs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.eval import cost
from draftsmith.eval.decoder import DraftingConfig, speculative_generate
from draftsmith.eval.proposers.ngram import NgramProposer
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.core.machine import machine_info
from draftsmith.core.sampling import SamplingConfig

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, then explain it.",
    "Repeat this list back to me, one item per line: apples, pears, plums, cherries, grapes.",
    "Summarise: The quick brown fox jumps over the lazy dog. The dog sleeps. The fox runs away.",
]


def _hf_generate(target, ids, n):
    ids = ids.to(target.model.device)
    out = target.model.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long, device=ids.device),
                                max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                pad_token_id=target.tokenizer.pad_token_id)
    return out[0, ids.numel():].tolist()


def _timed(fns: dict, repeats: int) -> dict:
    """Median seconds and last result per method; methods interleaved so load drifts hit all alike."""
    times, results = {k: [] for k in fns}, {}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), results[k]) for k, v in times.items()}


def _same_before_eos(ours, hf, eos) -> bool:
    """Equal up to our first EOS (HF's min_new_tokens suppresses EOS there; we ignore it and go on)."""
    m = next((i for i, t in enumerate(ours) if t in eos), len(ours))
    return ours[:m] == hf[:m]


def bench_dtype(dtype: str, args) -> dict:
    """Ours vs HF generate (and n-gram) at one dtype; the verify/step cost ratios at a 200-token cache."""
    n = args.max_new_tokens
    target = load_target(TargetConfig(name="smollm2", dtype=dtype, device=args.device))
    runner = TargetRunner(target.model, 1024, target.aux_layer_ids, cuda_graph=args.device.startswith("cuda"))
    greedy, chain = SamplingConfig(), DraftingConfig("chain", args.k)
    ngram = NgramProposer(ngram_max=3, ngram_min=1)
    sync = (lambda: torch.cuda.synchronize()) if args.device.startswith("cuda") else (lambda: None)

    def timed_call(fn):
        def call():
            r = fn()
            sync()
            return r
        return call

    rows = []
    with torch.inference_mode():
        for text in PROMPTS[: args.prompts]:
            ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                       return_tensors="pt", return_dict=True)["input_ids"][0]
            # EOS ignored: every method produces exactly n tokens
            fns = {
                # each lambda binds this prompt's ids (a default argument), not the loop's variable
                "ours": timed_call(lambda ids=ids: speculative_generate(runner, None, ids, n, greedy, chain,
                                                                        eos_token_ids=[])),
                "hf": timed_call(lambda ids=ids: _hf_generate(target, ids, n)),
            }
            if args.ngram:
                fns["ngram"] = timed_call(lambda ids=ids: speculative_generate(runner, ngram, ids, n, greedy, chain,
                                                                       eos_token_ids=[]))
            for fn in fns.values():  # warm-up
                fn()
            timed = _timed(fns, args.repeats)
            (t_ours, r_ours), (t_hf, r_hf) = timed["ours"], timed["hf"]
            eos = set(target.eos_token_ids)
            row = {"prompt_tokens": ids.numel(), "new_tokens": n, "hf_generate_tok_s": n / t_hf,
                   "ours_target_only_tok_s": n / t_ours, "ours_over_hf": t_hf / t_ours,
                   "ours_prefill_s": r_ours.prefill_s, "ours_decode_tok_s": (n - 1) / r_ours.decode_s,
                   "ours_equals_hf_before_eos": _same_before_eos(r_ours.tokens, r_hf, eos)}
            if args.ngram:
                t_ng, r_ng = timed["ngram"]
                row.update(ngram_tok_s=n / t_ng, ngram_tau=r_ng.tau, ngram_speedup=t_ours / t_ng,
                           ngram_equals_target_only=r_ng.tokens == r_ours.tokens)
            rows.append(row)
        costs = cost.measure_target(runner, 200, [1, 2, 3, 4, 5, 9], repeats=args.cost_repeats)
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    step = costs["step_s"]
    out = {"dtype": dtype, "hf_generate_tok_s": med("hf_generate_tok_s"),
           "ours_target_only_tok_s": med("ours_target_only_tok_s"), "ours_over_hf": med("ours_over_hf"),
           "step_ms_at_200": step * 1000,
           "verify_over_step_at_200": {k: v / step for k, v in costs["verify_s"].items()},
           "ours_equals_hf_before_eos": all(r["ours_equals_hf_before_eos"] for r in rows), "per_prompt": rows}
    if args.ngram:
        out.update(ngram_tau=med("ngram_tau"), ngram_speedup=med("ngram_speedup"))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", help="cpu | cuda (CUDA graphs on)")
    ap.add_argument("--ngram", action="store_true", help="also time n-gram speculative decoding")
    ap.add_argument("--cost-repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--out", default="bench_decoder.json")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"bench_decoder: --device {args.device} asked for, but torch sees no CUDA device "
                 f"(torch {torch.__version__}, cuda {torch.version.cuda}); run on a GPU machine or use --device cpu.")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    per_dtype = [bench_dtype(d, args) for d in args.dtypes]
    summary = {"target": "smollm2", "device": args.device, "threads": torch.get_num_threads(),
               "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "k": args.k,
               "goal": "ours_over_hf >= 1.2 at each dtype", "seconds": round(time.perf_counter() - t0, 1),
               "per_dtype": per_dtype}
    with open(args.out + ".tmp", "w") as f:
        summary["machine"] = machine_info()  # CPU kind, vector features, bf16, threads: beside every figure
        json.dump(summary, f, indent=2)
    os.replace(args.out + ".tmp", args.out)
    for d in per_dtype:
        ratios = ", ".join(f"{k}: {v:.2f}" for k, v in d["verify_over_step_at_200"].items())
        print(f"{d['dtype']:<9} ours {d['ours_target_only_tok_s']:.1f} tok/s, HF generate {d['hf_generate_tok_s']:.1f} "
              f"tok/s, ours/HF {d['ours_over_hf']:.2f}x (goal 1.2x); step {d['step_ms_at_200']:.1f} ms at a 200-token "
              f"cache, verify(n)/step {ratios}; same tokens as HF: {d['ours_equals_hf_before_eos']}", flush=True)
    print(f"wrote {args.out} ({summary['seconds']} s)")
    return summary


if __name__ == "__main__":
    main()
