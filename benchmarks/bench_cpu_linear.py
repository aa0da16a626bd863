"""Benchmark: what a verification of M tokens costs in torch's fp32 linear on this CPU, against a one-token step
(not a test).

    python benchmarks/bench_cpu_linear.py --out runs/bench_cpu_linear.json

A speculative decoder pays a verification of K+1 tokens per cycle; on a small target that is memory-bound at one
token, it should cost about one step. This times SmolLM2-135M's linear shapes (attention, MLP, the 49152-row
lm_head) at M = 1..8 rows in three formulations of the same product: `F.linear(x, W)` (what the target runs),
`x @ W.T` with W.T stored contiguous, and `(W @ x.T).T`. On a 2-core AMD EPYC Zen 3 (AVX2, torch's MKL) M >= 2 left
the one-row path and cost 2-2.6x as much (the lm_head 2.5x), which is why `eval`'s cost model there measures a
verification of 4 tokens at ~1.65 steps.

Second table: the lm_head over the last position of a (B, T, H) prefill, as `logits_to_keep=1` hands it (a
non-contiguous (B, 1, H) slice) and as an index tensor gathers it (a contiguous copy), in fp32 and bf16. On a 2-core
Xeon with AMX, torch 2.13.0, bf16 at B = 64 the slice took seconds where the gathered copy took milliseconds, which is
why data-gen's prefill passes the index (data_gen/batching.py). Run it alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from draftsmith.core.artifacts import atomic_write_json
from draftsmith.core.machine import machine_info

SHAPES = {"q/o (576x576)": (576, 576), "k/v (192x576)": (192, 576), "gate/up (1536x576)": (1536, 576),
          "down (576x1536)": (576, 1536), "lm_head (49152x576)": (49152, 576)}


def seconds(fn, repeats: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--prefill-rows", type=int, nargs="+", default=[1, 8, 64], help="second table: prefills at once")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    result = {"machine": machine_info(), "threads": torch.get_num_threads(), "rows": args.rows, "us": {}}
    for name, (out_features, in_features) in SHAPES.items():
        w = torch.randn(out_features, in_features)
        wt = w.t().contiguous()
        # w and wt bound per shape (default arguments), not read from the loop when called
        ways = {"linear": lambda x, w=w: torch.nn.functional.linear(x, w), "x@Wt": lambda x, wt=wt: x @ wt,
                "(W@x.T).T": lambda x, w=w: (w @ x.t()).t()}
        for way, fn in ways.items():
            us = [1e6 * seconds(lambda fn=fn, x=x: fn(x), args.repeats)
                  for x in (torch.randn(m, in_features) for m in args.rows)]
            result["us"][f"{name} {way}"] = us
            print(f"{name:<20} {way:<10} " + "  ".join(f"M={m}:{u:7.0f}us" for m, u in zip(args.rows, us)), flush=True)
    result["prefill_last_logits_ms"] = {}
    w = torch.randn(*SHAPES["lm_head (49152x576)"])
    for dtype in (torch.float32, torch.bfloat16):
        w_dtype = w.to(dtype)
        for b in args.prefill_rows:
            h = torch.randn(b, 40, 576, dtype=dtype)
            for way, x in (("slice", h[:, -1:, :]), ("gathered", h[:, torch.tensor([39]), :])):
                ms = 1e3 * seconds(lambda x=x, w_dtype=w_dtype: torch.nn.functional.linear(x, w_dtype), 2, warmup=1)
                result["prefill_last_logits_ms"][f"{str(dtype)[6:]} B={b} {way}"] = ms
                print(f"lm_head on the last of {b:>2} prefills, {str(dtype)[6:]:<8} {way:<9} {ms:9.1f} ms", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(args.out), result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
