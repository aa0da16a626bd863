"""Benchmark: what a verification of M tokens costs in torch's fp32 linear on this CPU, against a one-token step
(not a test).

    python benchmarks/bench_cpu_linear.py --out runs/bench_cpu_linear.json

A speculative decoder pays a verification of K+1 tokens per cycle; on a small target that is memory-bound at one
token, it should cost about one step. This times SmolLM2-135M's linear shapes (attention, MLP, the 49152-row
lm_head) at M = 1..8 rows in three formulations of the same product: `F.linear(x, W)` (what the target runs),
`x @ W.T` with W.T stored contiguous, and `(W @ x.T).T`. On a 2-core AMD EPYC Zen 3 (AVX2, torch's MKL) M >= 2 left
the one-row path and cost 2-2.6x as much (the lm_head 2.5x), which is why `eval`'s cost model there measures a
verification of 4 tokens at ~1.65 steps. Run it alone.
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


def seconds(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--out", required=True, help="the JSON file to write")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    result = {"machine": machine_info(), "threads": torch.get_num_threads(), "rows": args.rows, "us": {}}
    for name, (out_features, in_features) in SHAPES.items():
        w = torch.randn(out_features, in_features)
        wt = w.t().contiguous()
        ways = {"linear": lambda x: torch.nn.functional.linear(x, w), "x@Wt": lambda x: x @ wt,
                "(W@x.T).T": lambda x: (w @ x.t()).t()}
        for way, fn in ways.items():
            us = [1e6 * seconds(lambda: fn(x), args.repeats) for x in (torch.randn(m, in_features) for m in args.rows)]
            result["us"][f"{name} {way}"] = us
            print(f"{name:<20} {way:<10} " + "  ".join(f"M={m}:{u:7.0f}us" for m, u in zip(args.rows, us)), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(args.out), result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
