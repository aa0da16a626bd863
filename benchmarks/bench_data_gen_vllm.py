"""Benchmark of data-gen's two in-process backends on the embedded SmolLM2, side by side (not a test).

    python benchmarks/bench_data_gen_vllm.py --out runs/bench_data_gen_vllm.json [--dtype float32]
        [--prompts-n 32] [--max-new-tokens 96] [--batch 16] [--repeats 1] [--threads 2]

Greedy, the first user turns of Spec-Bench as prompts (rendered once, the same token ids for both):
  hf     draftsmith's generation (data_gen/batching.py), `--batch` rows, in this process
  vllm   backend=vllm (data_gen/regenerate.py VLLMBackend: one engine job, max_num_seqs = --batch), in the
         engine's venv (bash scripts/setup.sh --engine); its tokens/s count the decoding only (the engine's
         own clock, requests added to the last finished), and `wall_s` / `wall_tokens_per_s` the whole job,
         the engine's start included (what one regeneration chunk costs)
Tokens counted are the answer tokens before EOS. The runs alternate (hf, vllm) `--repeats` times and the
fastest of each is kept. The greedy answers are compared too (identical count, first differences).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from bench_data_gen import SPEC_BENCH, compare_answers, rate, useful, write_results
from draftsmith.data_gen.batching import generate_tokens
from draftsmith.data_gen.config import BackendConfig, PromptsConfig
from draftsmith.data_gen.prompts import load_prompts
from draftsmith.data_gen.regenerate import SamplingParams, VLLMBackend, prompt_ids
from draftsmith.data_gen.target import TargetConfig, load_target


def bench_hf(target, ids, params, batch) -> tuple[dict, list[list[int]]]:
    eos, t = set(target.eos_token_ids), time.perf_counter()
    outs = generate_tokens(target, ids, params, [0] * len(ids), batch_size=batch)
    answers = [useful(o, eos) for o, _ in outs]
    return rate(sum(map(len, answers)), time.perf_counter() - t, batch=batch), answers


def bench_vllm(backend, ids, eos) -> tuple[dict, list[list[int]]]:
    t = time.perf_counter()
    answers = [useful(o, eos) for o in backend.generate(ids, [0] * len(ids))]
    wall, n, run = time.perf_counter() - t, sum(map(len, answers)), backend.last_run
    return rate(n, run["seconds"], batch=backend.cfg.batch_size, load_s=round(run["load_s"], 2),
                wall_s=round(wall, 2), wall_tokens_per_s=round(n / wall, 2)), answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_data_gen_vllm.json")
    ap.add_argument("--prompts", default=SPEC_BENCH, help="Spec-Bench question.jsonl")
    ap.add_argument("--prompts-n", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=16, help="hf: rows; vllm: max_num_seqs")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the hf backend")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(TargetConfig(name="smollm2", dtype=args.dtype))
    samples = load_prompts(PromptsConfig(source="question", path=args.prompts, n=args.prompts_n))
    ids = prompt_ids(target.tokenizer, [s["messages"][:1] for s in samples])
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    vllm = VLLMBackend(target, BackendConfig(kind="vllm", batch_size=args.batch), params, dtype=args.dtype)
    eos = set(target.eos_token_ids)
    results = {"target": "smollm2", "dtype": args.dtype, "prompts_n": len(ids), "batch": args.batch,
               "max_new_tokens": args.max_new_tokens, "threads": args.threads, "greedy": True,
               "repeats": args.repeats, "load_average_at_start": os.getloadavg()}
    bench_hf(target, ids[:2], SamplingParams(max_new_tokens=4), 2)  # warm-up
    runs: dict = {"hf": [], "vllm": []}
    answers: dict = {}
    for _ in range(args.repeats):
        r, answers["hf"] = bench_hf(target, ids, params, args.batch)
        runs["hf"].append(r)
        r, answers["vllm"] = bench_vllm(vllm, ids, eos)
        runs["vllm"].append(r)
    hf, vl = (min(runs[k], key=lambda x: x["seconds"]) for k in ("hf", "vllm"))
    results.update(hf=hf, vllm=vl, vllm_vs_hf=round(vl["tokens_per_s"] / hf["tokens_per_s"], 2),
                   vllm_wall_vs_hf=round(vl["wall_tokens_per_s"] / hf["tokens_per_s"], 2),
                   vllm_version=vllm.last_run["vllm_version"], answers=compare_answers(answers["hf"], answers["vllm"]))
    print(f"\n{args.dtype}: {len(ids)} prompts, max_new_tokens {args.max_new_tokens}, batch {args.batch}\n"
          f"  hf    {hf['tokens_per_s']:8.2f} tok/s  ({hf['tokens']} tokens, {hf['seconds']} s)\n"
          f"  vllm  {vl['tokens_per_s']:8.2f} tok/s  decoding; {vl['wall_tokens_per_s']:.2f} tok/s with the engine's "
          f"start ({vl['load_s']} s load, {vl['wall_s']} s in all)\n"
          f"  vllm / hf = {results['vllm_vs_hf']:.2f}x decoding, {results['vllm_wall_vs_hf']:.2f}x with the start\n"
          f"  greedy answers: {results['answers']['identical']} of {results['answers']['answers']} identical",
          file=sys.stderr, flush=True)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
