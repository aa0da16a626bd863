"""Benchmark of data-gen's generation on the embedded SmolLM2 (not a test).

    python benchmarks/bench_data_gen.py --out runs/bench_data_gen.json [--dtypes float32,bfloat16]
        [--prompts-n 32] [--max-new-tokens 96] [--batches 16,32] [--one-prompts 3] [--repeats 1]

Greedy, the first user turns of Spec-Bench as prompts, side by side in one run:
  ours               draftsmith's generation (data_gen/batching.py: static KV cache, finished rows
                     refilled with waiting prompts), at each of --batches; its best batch is reported
  hf_batched         transformers `generate` on left-padded batches of the same size (prompts sorted
                     by length as ours are, so padding is as small as HF allows)
  hf_one_at_a_time   transformers `generate`, one prompt at a time (the first --one-prompts prompts)
Tokens counted are the answer tokens before EOS; the time includes the prompts' prefill. The runs
alternate (ours b1, HF b1, ours b2, HF b2, ..., one at a time) `--repeats` times and the fastest of
each is kept, so that load from other processes on a shared machine hits all alike.
With two dtypes it also compares the greedy answers across dtypes (same prompts, ours at the best
batch): how many are token-identical and where the first difference falls.
--capture adds hidden-state capture tokens/s and bytes stored per token (bound (3 + 1) * H * 2 in bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.core.artifacts import atomic_write_json
from draftsmith.core.machine import machine_info
from draftsmith.data_gen.batching import generate_tokens
from draftsmith.data_gen.capture import capture_hidden_states
from draftsmith.data_gen.config import PromptsConfig
from draftsmith.data_gen.prompts import load_prompts
from draftsmith.data_gen.regenerate import SamplingParams
from draftsmith.data_gen.target import TargetConfig, load_target

SPEC_BENCH = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_question.jsonl")  # ../shared beside the repo
GOAL_VS_HF_BATCHED, GOAL_VS_ONE = 1.0, 10.0  # issue 12, item 1


def prompt_ids(target, n: int, path: str) -> list[list[int]]:
    tok = target.tokenizer
    samples = load_prompts(PromptsConfig(source="question", path=path, n=n))
    texts = [tok.apply_chat_template(s["messages"][:1], tokenize=False, add_generation_prompt=True) for s in samples]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def useful(new_ids: list[int], eos: set[int]) -> list[int]:
    return new_ids[: next((i for i, t in enumerate(new_ids) if t in eos), len(new_ids))]


def rate(n: int, seconds: float, **extra) -> dict:
    return {"tokens": n, "seconds": round(seconds, 2), "tokens_per_s": round(n / seconds, 2), **extra}


def bench_ours(target, ids, max_new, batch) -> tuple[dict, list[list[int]]]:
    t = time.perf_counter()
    outs = generate_tokens(target, ids, SamplingParams(max_new_tokens=max_new), [0] * len(ids), batch_size=batch)
    return rate(sum(len(o) for o, _ in outs), time.perf_counter() - t, batch=batch), [o for o, _ in outs]


@torch.inference_mode()
def bench_hf_batched(target, ids, max_new, batch) -> dict:
    eos, pad, n, t = set(target.eos_token_ids), target.tokenizer.pad_token_id, 0, time.perf_counter()
    order = sorted(ids, key=len, reverse=True)
    for b in range(0, len(order), batch):
        chunk = order[b:b + batch]
        T = max(map(len, chunk))
        input_ids = torch.tensor([[pad] * (T - len(x)) + x for x in chunk])
        attn = torch.tensor([[0] * (T - len(x)) + [1] * len(x) for x in chunk])
        out = target.model.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=max_new,
                                    do_sample=False, pad_token_id=pad)
        n += sum(len(useful(row[T:].tolist(), eos)) for row in out)
    return rate(n, time.perf_counter() - t, batch=batch)


@torch.inference_mode()
def bench_hf_one(target, ids, max_new) -> dict:
    eos, n, t = set(target.eos_token_ids), 0, time.perf_counter()
    for x in ids:
        out = target.model.generate(torch.tensor([x]), max_new_tokens=max_new, do_sample=False,
                                    pad_token_id=target.tokenizer.pad_token_id)
        n += len(useful(out[0, len(x):].tolist(), eos))
    return rate(n, time.perf_counter() - t, prompts=len(ids))


def bench_capture(target, ids, answers) -> dict:
    seqs = [x + o for x, o in zip(ids, answers)]
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        index = capture_hidden_states(target, seqs, d, "bfloat16", samples_per_shard=8, batch_size=8)
        dt = time.perf_counter() - t
        nbytes = sum(e["bytes"] for e in index["shards"])
    n = sum(map(len, seqs))
    return rate(n, dt, bytes_per_token=round(nbytes / n, 1), bound_bytes_per_token=4 * target.hidden_size * 2)


def bench_dtype(dtype: str, args) -> tuple[dict, list[list[int]]]:
    target = load_target(TargetConfig(name="smollm2", dtype=dtype))
    ids = prompt_ids(target, args.prompts_n, args.prompts)
    bench_ours(target, ids[:2], 4, 2)  # warm-up
    runs: dict = {b: {"ours": [], "hf_batched": []} for b in args.batches}
    one, answers = [], {}
    for _ in range(args.repeats):
        for b in args.batches:
            r, answers[b] = bench_ours(target, ids, args.max_new_tokens, b)
            runs[b]["ours"].append(r)
            runs[b]["hf_batched"].append(bench_hf_batched(target, ids, args.max_new_tokens, b))
        one.append(bench_hf_one(target, ids[:args.one_prompts], args.max_new_tokens))
    fastest = lambda xs: min(xs, key=lambda x: x["seconds"])  # noqa: E731
    per_batch = {}
    for b in args.batches:
        ours, hf = fastest(runs[b]["ours"]), fastest(runs[b]["hf_batched"])
        per_batch[str(b)] = {"ours": ours, "hf_batched": hf,
                             "ours_vs_hf_batched": round(ours["tokens_per_s"] / hf["tokens_per_s"], 2)}
    best = max(args.batches, key=lambda b: per_batch[str(b)]["ours"]["tokens_per_s"])
    ours, hf, one = per_batch[str(best)]["ours"], per_batch[str(best)]["hf_batched"], fastest(one)
    r = {"best_batch": best, "ours": ours, "hf_batched": hf, "hf_one_at_a_time": one,
         "ours_vs_hf_batched": round(ours["tokens_per_s"] / hf["tokens_per_s"], 2),
         "ours_vs_one_at_a_time": round(ours["tokens_per_s"] / one["tokens_per_s"], 2),
         "per_batch": per_batch}
    r["goals_met"] = {f"ours_vs_hf_batched >= {GOAL_VS_HF_BATCHED}": r["ours_vs_hf_batched"] >= GOAL_VS_HF_BATCHED,
                      f"ours_vs_one_at_a_time >= {GOAL_VS_ONE}": r["ours_vs_one_at_a_time"] >= GOAL_VS_ONE}
    if args.capture:
        r["capture"] = bench_capture(target, ids, answers[best])
    print(f"\n{dtype}: {len(ids)} prompts, max_new_tokens {args.max_new_tokens}, best batch {best}", file=sys.stderr)
    for b in args.batches:
        p = per_batch[str(b)]
        print(f"  batch {b:3d}: ours {p['ours']['tokens_per_s']:8.2f} tok/s   hf_batched "
              f"{p['hf_batched']['tokens_per_s']:8.2f} tok/s   ours/hf {p['ours_vs_hf_batched']:.2f}x", file=sys.stderr)
    print(f"  hf_one_at_a_time: {one['tokens_per_s']:.2f} tok/s ({one['prompts']} prompts)\n"
          f"  ours (batch {best}) / hf_batched (batch {best}) = {r['ours_vs_hf_batched']:.2f}x   "
          f"ours / one at a time = {r['ours_vs_one_at_a_time']:.2f}x", file=sys.stderr, flush=True)
    return r, answers[best]


def compare_answers(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two dtypes' greedy answers agree: identical answers, and the first differing token."""
    firsts = [next((k for k, (x, y) in enumerate(zip(u, v)) if x != y), min(len(u), len(v)))
              for u, v in zip(a, b) if u != v]
    return {"answers": len(a), "identical": len(a) - len(firsts),
            "first_difference_at": sorted(firsts),
            "tokens_before_first_difference_share": round(
                (sum(firsts) + sum(len(u) for u, v in zip(a, b) if u == v)) / max(1, sum(map(len, a))), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_data_gen.json")
    ap.add_argument("--prompts", default=SPEC_BENCH, help="Spec-Bench question.jsonl")
    ap.add_argument("--prompts-n", type=int, default=32, help="prompts of the batched runs")
    ap.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    ap.add_argument("--batches", default="16,32", help="comma-separated batch sizes tried")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--one-prompts", type=int, default=3, help="prompts for the one-at-a-time baseline")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--capture", action="store_true", help="also time hidden-state capture")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    results = {"target": "smollm2", "prompts_n": args.prompts_n, "batches": args.batches,
               "max_new_tokens": args.max_new_tokens, "threads": args.threads, "greedy": True,
               "repeats": args.repeats, "load_average_at_start": os.getloadavg()}
    answers = {}
    for dtype in args.dtypes.split(","):
        results[dtype], answers[dtype] = bench_dtype(dtype, args)
    if len(answers) == 2:
        (d1, a1), (d2, a2) = answers.items()
        results[f"{d2}_vs_{d1}_answers"] = compare_answers(a1, a2)
        print(f"\n{d2} vs {d1} greedy answers: " + json.dumps(results[f"{d2}_vs_{d1}_answers"]), file=sys.stderr)
    write_results(args.out, results)


def write_results(path: str, results: dict) -> None:
    """The load at the end and the machine beside the figures, written atomically to `path`, and printed."""
    results["load_average_at_end"] = os.getloadavg()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    results["machine"] = machine_info()  # CPU kind, vector features, bf16, threads: beside every figure
    atomic_write_json(out, results)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
