"""Benchmark: P-EAGLE vs EAGLE-3 on the embedded SmolLM2 at an equal training budget (not a test).

    python benchmarks/bench_peagle.py --data runs/bench_peagle/data --out runs/bench_peagle --steps 150
        [--eagle3-head DIR] [--peagle-head DIR] [--ks 3 5 7] [--holdout 6] [--max-new-tokens 64] [--repeats 1]

1. train (unless a head folder is given, or `<out>/<method>/final` is there): an EAGLE-3 head and a P-EAGLE head on the same data-gen output, same
   steps, micro-batch, learning rate, precision and held-out rows (`val_samples=--holdout`), online;
2. decode the held-out prompts (`prompts.source=holdout`) at temperature 0 with the built-in decoder: target
   only, then each head at every K (chain), methods interleaved per prompt;
3. print and write `<out>/bench_peagle.json`: per (method, K) tau, per-position acceptance, the drafter's
   milliseconds per cycle and its share of decode time (timed around the proposer's update + propose), tokens/s
   and speedup against target-only decoding (same decoder, prompts and target; warm-up excluded).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from draftsmith.core.machine import machine_info
from draftsmith.configs import compose
from draftsmith.core.artifacts import atomic_write_json


class TimedProposer:
    """A proposer with a stopwatch around the drafter's work (update + propose); everything else delegated."""

    def __init__(self, inner):
        self.inner, self.seconds, self.cycles = inner, 0.0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reset(self, prompt_ids):
        self.inner.reset(prompt_ids)

    def update(self, tokens, aux):
        t0 = time.perf_counter()
        self.inner.update(tokens, aux)
        self.seconds += time.perf_counter() - t0

    def propose(self, drafting, sampling, generator=None):
        t0 = time.perf_counter()
        draft = self.inner.propose(drafting, sampling, generator)
        self.seconds += time.perf_counter() - t0
        self.cycles += 1
        return draft


def train(method: str, args, out: Path, extra: list[str]) -> tuple[Path, float]:
    """Train one head with the shared budget; (its final folder, wall seconds)."""
    from draftsmith.train.run import run

    overrides = [f"method={method}", f"target={args.target}", f"data={args.data}", f"out={out}",
                 f"max_steps={args.steps}", f"val_samples={args.holdout}", f"micro_batch_size={args.micro_batch_size}",
                 f"lr={args.lr}", f"precision={args.precision}", f"max_length={args.max_length}",
                 f"method.draft_vocab_size={args.draft_vocab_size}", "progress=false", "wandb.mode=disabled",
                 "deepspeed=none", "overwrite=true", *extra]
    t0 = time.perf_counter()
    result = run(compose("train", overrides))
    return Path(result["final"]), time.perf_counter() - t0


def evaluate(args, heads: dict[str, Path]) -> dict:
    """Target-only and every (head, K) on the held-out prompts, interleaved; rows of figures."""
    from draftsmith.eval import metrics
    from draftsmith.eval.decoder import DraftingConfig
    from draftsmith.eval.run import decode_conversation, load_drafter, prepare, to_sample

    kmax = max(args.ks)
    cfg = compose("eval", [f"target={args.target}", "head=none", "prompts.source=holdout", f"prompts.path={args.data}",
                           f"prompts.holdout={args.holdout}", "prompts.n=null", "temperature=0",
                           f"drafting.num_speculative_tokens={kmax}", f"max_new_tokens={args.max_new_tokens}",
                           f"out={args.out / 'eval'}", "overwrite=true", "progress=false", "plot=false"])
    setup = prepare(cfg)
    target, runner = setup.target, setup.runner
    proposers = {}
    for name, folder in heads.items():
        cfg.head = str(folder)
        drafter = load_drafter(cfg, target, runner.max_len)
        proposers[name] = TimedProposer(drafter.make())
    runs = [("target_only", None, 0)] + [(name, proposers[name], k) for name in heads for k in args.ks]

    def decode(proposer, k, prompt):
        return decode_conversation(runner, proposer, target.tokenizer, prompt, cfg.max_new_tokens, setup.sampling,
                                   DraftingConfig("chain", max(k, 1)), target.eos_token_ids, cfg.seed)

    for prompt in setup.prompts[:1]:  # warm-up: every path once, nothing recorded
        for _, proposer, k in runs:
            decode(proposer, k, prompt)
    samples = {(name, k): [] for name, _, k in runs}
    drafter_s = {(name, k): 0.0 for name, _, k in runs}
    cycles = dict(drafter_s)
    identical = {(name, k): [] for name, _, k in runs}
    for prompt in setup.prompts:
        results = {}
        for rep in range(args.repeats):
            for name, proposer, k in runs:
                if proposer is not None:
                    proposer.seconds, proposer.cycles = 0.0, 0
                out = decode(proposer, k, prompt)
                results.setdefault((name, k), []).append(out)
                if proposer is not None and rep == 0:
                    drafter_s[(name, k)] += proposer.seconds
                    cycles[(name, k)] += proposer.cycles
        for key, reps in results.items():
            for turn in range(len(prompt.turns)):
                samples[key].append(to_sample(prompt.category, [r[turn] for r in reps]))
                identical[key].append(reps[0][turn].tokens == results[("target_only", 0)][0][turn].tokens)
    base = samples[("target_only", 0)]
    rows = []
    for (name, k), ss in samples.items():
        if name == "target_only":
            continue
        c = metrics.compare(ss, base)
        decode_s = sum(s.seconds for s in ss)
        rows.append({"method": name, "k": k, "tau": c["tau"], "per_position_acceptance": c["per_position_acceptance"],
                     "drafter_ms_per_cycle": 1000 * drafter_s[(name, k)] / max(cycles[(name, k)], 1),
                     "drafter_share_of_decode": drafter_s[(name, k)] / decode_s if decode_s else None,
                     "tokens_per_s": c["speculative_tokens_per_s"], "speedup": c["speedup"],
                     "greedy_identical_fraction": sum(identical[(name, k)]) / max(len(identical[(name, k)]), 1)})
    return {"rows": rows, "target_only_tokens_per_s": metrics.aggregate(base)["tokens_per_s"],
            "n_prompts": len(setup.prompts), "prompt_ids": [p.id for p in setup.prompts]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a data-gen output for the target (prompts=self is fine)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_peagle"))
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--eagle3-head", default=None, help="a trained EAGLE-3 folder: skip its training")
    ap.add_argument("--peagle-head", default=None, help="a trained P-EAGLE folder: skip its training")
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps of each training (the shared budget)")
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--max-length", type=int, default=384)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--peagle-layers", type=int, default=4)
    ap.add_argument("--peagle-depths", type=int, default=8)
    ap.add_argument("--holdout", type=int, default=6, help="last rows of the data: never trained on, decoded here")
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    result: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    heads, train_s = {}, {}
    for name, given, extra in (("eagle3", args.eagle3_head, []),
                               ("peagle", args.peagle_head, [f"method.num_layers={args.peagle_layers}",
                                                             f"method.depths={args.peagle_depths}"])):
        done = args.out / name / "final"
        if given or (done / "config.json").is_file():  # a given head, or this script's earlier training
            heads[name] = Path(given) if given else done
            print(f"{name}: using {heads[name]} (not trained here)", flush=True)
        else:
            heads[name], train_s[name] = train(name, args, args.out / name, extra)
            print(f"trained {name}: {args.steps} steps in {train_s[name]:.0f} s -> {heads[name]}", flush=True)
    result["train_seconds"] = train_s
    result["heads"] = {k: str(v) for k, v in heads.items()}
    torch.manual_seed(0)
    result.update(evaluate(args, heads))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"T=0, chain, {result['n_prompts']} held-out prompts, target-only {result['target_only_tokens_per_s']:.1f} tok/s")
    print(f"{'method':<7} {'K':>2} {'tau':>5} {'drafter ms/cycle':>16} {'share':>6} {'tok/s':>6} {'speedup':>7}  "
          f"per-position acceptance")
    for r in result["rows"]:
        acc = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
        print(f"{r['method']:<7} {r['k']:>2} {r['tau']:5.2f} {r['drafter_ms_per_cycle']:16.1f} "
              f"{r['drafter_share_of_decode']:6.2f} {r['tokens_per_s']:6.1f} {r['speedup']:6.2f}x  {acc}"
              + ("" if r["greedy_identical_fraction"] == 1 else
                 f"  greedy identical on {r['greedy_identical_fraction']:.0%} of turns"))
    best = {m: max((r for r in result["rows"] if r["method"] == m), key=lambda r: r["speedup"]) for m in heads}
    result["best"] = {m: {"k": r["k"], "speedup": r["speedup"]} for m, r in best.items()}
    if {"eagle3", "peagle"} <= set(best):
        result["peagle_over_eagle3_at_best_k"] = best["peagle"]["speedup"] / best["eagle3"]["speedup"]
        print(f"best K: eagle3 K={best['eagle3']['k']} {best['eagle3']['speedup']:.2f}x, peagle "
              f"K={best['peagle']['k']} {best['peagle']['speedup']:.2f}x -> ratio "
              f"{result['peagle_over_eagle3_at_best_k']:.2f}")
    result["machine"] = machine_info()  # CPU kind, vector features, bf16, threads: beside every figure
    atomic_write_json(args.out / "bench_peagle.json", result)
    print(f"wrote {args.out / 'bench_peagle.json'} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
