"""Benchmark of the data-gen stage on the embedded SmolLM2 (not a test).

    python scripts/bench_data_gen.py --out bench_data_gen.json [--max-new-tokens 64] [--batch 16]

Side by side, in fp32 and bf16, greedy, the first user turns of Spec-Bench as prompts:
  ours_batched        draftsmith's batched decode loop (generate_tokens), batch 16
  hf_one_at_a_time    transformers `generate`, one prompt at a time
  hf_batched          transformers `generate`, left-padded batch 16
and hidden-state capture tokens/s with bytes stored per token (bound: (3 + 1) * H * 2 in bf16).
Tokens counted are the generated tokens before EOS. The batched runs alternate (ours, HF,
ours, HF, ...) `--repeats` times and report the fastest of each, so that load from other
processes on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.data_gen.capture import capture_hidden_states
from draftsmith.data_gen.config import PromptsConfig
from draftsmith.data_gen.prompts import load_prompts
from draftsmith.data_gen.regenerate import SamplingParams, generate_tokens
from draftsmith.data_gen.target import TargetConfig, load_target

SPEC_BENCH = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_question.jsonl")  # ../shared beside the repo


def prompt_ids(target, n: int, path: str) -> list[list[int]]:
    tok = target.tokenizer
    samples = load_prompts(PromptsConfig(source="question", path=path, n=n))
    texts = [tok.apply_chat_template(s["messages"][:1], tokenize=False, add_generation_prompt=True) for s in samples]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def useful(new_ids: list[int], eos: set[int]) -> int:
    return next((i for i, t in enumerate(new_ids) if t in eos), len(new_ids))


def bench_ours(target, ids, max_new, batch) -> dict:
    t = time.perf_counter()
    outs = generate_tokens(target, ids, SamplingParams(max_new_tokens=max_new), [0] * len(ids), batch_size=batch)
    dt = time.perf_counter() - t
    n = sum(len(o) for o, _ in outs)
    return {"tokens": n, "seconds": round(dt, 2), "tokens_per_s": round(n / dt, 1)}


@torch.no_grad()
def bench_hf_one(target, ids, max_new) -> dict:
    eos, n, t = set(target.eos_token_ids), 0, time.perf_counter()
    for x in ids:
        out = target.model.generate(torch.tensor([x]), max_new_tokens=max_new, do_sample=False,
                                    pad_token_id=target.tokenizer.pad_token_id)
        n += useful(out[0, len(x):].tolist(), eos)
    dt = time.perf_counter() - t
    return {"tokens": n, "seconds": round(dt, 2), "tokens_per_s": round(n / dt, 1), "prompts": len(ids)}


@torch.no_grad()
def bench_hf_batched(target, ids, max_new, batch) -> dict:
    eos, pad, n, t = set(target.eos_token_ids), target.tokenizer.pad_token_id, 0, time.perf_counter()
    for b in range(0, len(ids), batch):
        chunk = ids[b:b + batch]
        T = max(map(len, chunk))
        input_ids = torch.tensor([[pad] * (T - len(x)) + x for x in chunk])
        attn = torch.tensor([[0] * (T - len(x)) + [1] * len(x) for x in chunk])
        out = target.model.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=max_new,
                                    do_sample=False, pad_token_id=pad)
        n += sum(useful(row[T:].tolist(), eos) for row in out)
    dt = time.perf_counter() - t
    return {"tokens": n, "seconds": round(dt, 2), "tokens_per_s": round(n / dt, 1)}


def bench_capture(target, ids, max_new, batch) -> dict:
    outs = generate_tokens(target, ids, SamplingParams(max_new_tokens=max_new), [0] * len(ids), batch_size=batch)
    seqs = [x + o for x, (o, _) in zip(ids, outs)]
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        index = capture_hidden_states(target, seqs, d, "bfloat16", samples_per_shard=8, batch_size=8)
        dt = time.perf_counter() - t
        nbytes = sum(e["bytes"] for e in index["shards"])
    n = sum(map(len, seqs))
    return {"tokens": n, "seconds": round(dt, 2), "tokens_per_s": round(n / dt, 1),
            "bytes_per_token": round(nbytes / n, 1), "bound_bytes_per_token": 4 * target.hidden_size * 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_data_gen.json")
    ap.add_argument("--prompts", default=SPEC_BENCH)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--one-at-a-time", type=int, default=2, help="prompts for the one-at-a-time baseline")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import os

    results = {"target": "smollm2", "batch": args.batch, "max_new_tokens": args.max_new_tokens,
               "threads": args.threads, "greedy": True, "repeats": args.repeats,
               "load_average_at_start": os.getloadavg()}
    for dtype in ("float32", "bfloat16"):
        target = load_target(TargetConfig(name="smollm2", dtype=dtype))
        ids = prompt_ids(target, args.batch, args.prompts)
        bench_ours(target, ids[:2], 4, 2)  # warm-up
        runs = {"ours_batched": [], "hf_batched": []}
        for _ in range(args.repeats):
            runs["ours_batched"].append(bench_ours(target, ids, args.max_new_tokens, args.batch))
            runs["hf_batched"].append(bench_hf_batched(target, ids, args.max_new_tokens, args.batch))
        r = {k: min(v, key=lambda x: x["seconds"]) for k, v in runs.items()}
        r["hf_one_at_a_time"] = bench_hf_one(target, ids[: args.one_at_a_time], args.max_new_tokens)
        r["ours_vs_one_at_a_time"] = round(r["ours_batched"]["tokens_per_s"] / r["hf_one_at_a_time"]["tokens_per_s"], 2)
        r["ours_vs_hf_batched"] = round(r["ours_batched"]["tokens_per_s"] / r["hf_batched"]["tokens_per_s"], 2)
        if dtype == "bfloat16":
            r["capture"] = bench_capture(target, ids, args.max_new_tokens, args.batch)
        results[dtype] = r
        print(f"{dtype}: " + json.dumps(r), file=sys.stderr)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
