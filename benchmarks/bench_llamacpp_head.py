"""Benchmark: the head's GGUF weight type in llama.cpp, against the embedded Q4_1 target (not a test).

    python benchmarks/bench_llamacpp_head.py --head runs/demo/head/final --data runs/demo/data --holdout 10 \\
        --outtypes f32 f16 bf16 q8_0 --ks 1 2 3 --rounds 2 --out runs/bench_llamacpp_head.json

A CPU user serves the embedded SmolLM2 as its own Q4_1 GGUF; at f32 the head weighs about half as much as that
4-bit target and each drafted token costs a large share of a step. This writes the head with `export format=gguf
gguf_outtype=<t>` for each --outtypes (what picks llama.cpp's OUTTYPE, the default of export's and eval's
gguf_outtype) and decodes the held-out prompts (greedy, one llama-server per row, rows in turn, every row once per
round) with target-only, n-gram lookup, and the head at each --outtypes and each --ks, alone and after n-gram
lookup (llama.cpp's mixing); prints and writes tau (llama.cpp's counters), tokens/s and speedup over the round's
target-only, and per row the median over rounds. Every row's output is checked token-identical to target-only
(lossless). Run it alone: two processes on 2 cores distort every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.core import llamacpp
from draftsmith.core.artifacts import atomic_write_json
from draftsmith.configs import compose
from draftsmith.eval.cost import llamacpp_settings
from draftsmith.eval.engine_llamacpp import decode_run, target_gguf
from draftsmith.eval.engine_vllm import figures
from draftsmith.eval.proposers.ngram import NGRAM_ENGINES
from draftsmith.eval.prompts import render
from draftsmith.export import run as export
from draftsmith.core.machine import machine_info
from draftsmith.core.methods import methods


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", required=True, help="an EAGLE-3 head folder (train's final/)")
    ap.add_argument("--data", required=True, help="the data-gen output whose last --holdout prompts are decoded")
    ap.add_argument("--holdout", type=int, default=10)
    ap.add_argument("--outtypes", nargs="+", default=list(llamacpp.OUTTYPES), choices=llamacpp.OUTTYPES)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="every row decoded this many times, rows in turn")
    ap.add_argument("--out", required=True, help="the JSON file to write")
    args = ap.parse_args(argv)
    from draftsmith.eval.run import prepare

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-head-") as tmp:
        cfg = compose("eval", ["target=smollm2", "head=none", "prompts.source=holdout", f"prompts.path={args.data}",
                               f"prompts.holdout={args.holdout}", "prompts.n=null", f"out={Path(tmp) / 'eval'}",
                               "progress=false", "plot=false"])
        setup = prepare(cfg)
        prompts = [render(setup.target.tokenizer, p, []) for p in setup.prompts]  # first turns
        model = target_gguf(setup.target, "same")  # the embedded Q4_1 file
        heads = {t: export(compose("export", [f"head={args.head}", "format=gguf", f"gguf_outtype={t}",
                                              f"out={Path(tmp) / ('gguf-' + t)}"])) / "eagle3.gguf"
                 for t in args.outtypes}
        engines = methods()["eagle3"].engines
        ctx = max(map(len, prompts)) + args.max_new_tokens + max(args.ks) + 64
        ngram = llamacpp_settings("ngram", NGRAM_ENGINES, max(args.ks), args.ngram_max)["flags"]
        rows = [("target_only", None, {"name": "target_only", "flags": [], "draft": False}),
                ("ngram", None, {"name": "ngram", "draft": False, "flags": ngram})]
        for t in args.outtypes:
            for k in args.ks:
                for mixed in (False, True):
                    name = f"{'ngram+' if mixed else ''}eagle3 {t} K={k}"
                    flags = llamacpp_settings("eagle3", engines, k, args.ngram_max, ngram_first=mixed)["flags"]
                    rows.append((name, t, {"name": name, "flags": flags, "draft": True}))
        threads = torch.get_num_threads()
        result = {"settings": vars(args), "target": str(model), "machine": machine_info(),
                  "head_bytes": {t: p.stat().st_size for t, p in heads.items()}, "rows": []}
        for round_ in range(args.rounds):
            base = None  # the round's target-only: its tokens and tokens/s (the first row)
            for name, t, run in rows:
                r = decode_run(model, heads[t] if t else None, run, prompts, args.max_new_tokens, 1, 1, threads, ctx)
                tps = sum(map(len, r["tokens"])) / sum(r["seconds"])
                if base is None:
                    base = (r["tokens"], tps)
                row = {"row": name, "round": round_, "tokens_per_s": tps, "speedup": tps / base[1],
                       "tau": figures(r["counters"])["tau"] if "counters" in r else None,  # vLLM's counting
                       "lossless": r["tokens"] == base[0]}
                result["rows"].append(row)
                print(f"{round_} {name:<28} tau {row['tau'] or 0:5.2f}  {tps:7.1f} tok/s  {row['speedup']:.3f}x"
                      + ("" if row["lossless"] else "  OUTPUT DIFFERS FROM TARGET-ONLY"), flush=True)
                result["seconds"] = round(time.perf_counter() - t0, 1)
                atomic_write_json(Path(args.out), result)
        result["median"] = {name: {key: statistics.median(r[key] for r in result["rows"] if r["row"] == name)
                                   for key in ("tokens_per_s", "speedup")} for name, _, _ in rows}
        for name, m in result["median"].items():
            print(f"median {name:<28} {m['tokens_per_s']:7.1f} tok/s  {m['speedup']:.3f}x")
        atomic_write_json(Path(args.out), result)
    print(json.dumps(result["head_bytes"]), f"wrote {args.out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
