"""Benchmark the built-in decoder on SmolLM2: target-only tokens/s vs transformers' greedy `generate`,
and n-gram speculative τ / speedup. Warm-up excluded, median of repeats. Prints and writes JSON.

    python scripts/bench_decoder.py --max-new-tokens 64 --repeats 3 --threads 1 --out bench_decoder.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.eval.decoder import DraftingConfig, speculative_generate
from draftsmith.eval.proposers import NgramProposer
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.sampling import SamplingConfig

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, then explain it.",
    "Repeat this list back to me, one item per line: apples, pears, plums, cherries, grapes.",
    "Summarise: The quick brown fox jumps over the lazy dog. The dog sleeps. The fox runs away.",
]


def _hf_generate(target, ids, n):
    out = target.model.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
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


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--out", default="bench_decoder.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.max_new_tokens

    target = load_target(TargetConfig(name="smollm2"))
    runner = TargetRunner(target.model, 1024, target.aux_layer_ids)
    greedy, chain = SamplingConfig(), DraftingConfig("chain", args.k)
    ngram = NgramProposer(ngram_max=3, ngram_min=1)
    rows = []
    with torch.inference_mode():
        for text in PROMPTS:
            ids = target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                       return_tensors="pt", return_dict=True)["input_ids"][0]
            # EOS ignored: every method produces exactly n tokens
            fns = {
                "ours": lambda: speculative_generate(runner, None, ids, n, greedy, chain, eos_token_ids=[]),
                "hf": lambda: _hf_generate(target, ids, n),
                "ngram": lambda: speculative_generate(runner, ngram, ids, n, greedy, chain, eos_token_ids=[]),
            }
            for fn in fns.values():  # warm-up
                fn()
            timed = _timed(fns, args.repeats)
            (t_ours, r_ours), (t_hf, r_hf), (t_ng, r_ng) = timed["ours"], timed["hf"], timed["ngram"]
            eos = set(target.eos_token_ids)
            rows.append({
                "prompt_tokens": ids.numel(), "new_tokens": n,
                "hf_generate_tok_s": n / t_hf, "ours_target_only_tok_s": n / t_ours,
                "ours_prefill_s": r_ours.prefill_s, "ours_decode_tok_s": (n - 1) / r_ours.decode_s,
                "ngram_tok_s": n / t_ng, "ngram_tau": r_ng.tau, "ngram_speedup": t_ours / t_ng,
                "ngram_accept_rate_per_position": [a / max(p, 1) for a, p in
                                                   zip(r_ng.accepted_per_position, r_ng.proposed_per_position)],
                "ours_equals_hf_before_eos": _same_before_eos(r_ours.tokens, r_hf, eos),
                "ngram_equals_target_only": r_ng.tokens == r_ours.tokens,
            })
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    summary = {
        "target": "smollm2 fp32", "threads": torch.get_num_threads(), "max_new_tokens": n,
        "repeats": args.repeats, "k": args.k,
        "hf_generate_tok_s": med("hf_generate_tok_s"), "ours_target_only_tok_s": med("ours_target_only_tok_s"),
        "ngram_tok_s": med("ngram_tok_s"), "ngram_tau": med("ngram_tau"), "ngram_speedup": med("ngram_speedup"),
        "per_prompt": rows,
    }
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k != "per_prompt"}, indent=2))
    return summary


if __name__ == "__main__":
    main()
