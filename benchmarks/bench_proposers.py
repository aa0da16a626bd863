"""Benchmark: dynamic draft length vs fixed K, and n-gram + head vs each alone (not a test).

    python benchmarks/bench_proposers.py dynamic --heads runs/bench_peagle/eagle3/final runs/bench_peagle/peagle/final \\
        --prompts holdout --data runs/bench_peagle/data --holdout 6 --k 5 --fixed-ks 1 2 3 5 \\
        --stop-below 0.1 0.2 0.4 --max-new-tokens 40 --out runs/bench_proposers/dynamic.json
    python benchmarks/bench_proposers.py ngram --heads runs/bench_peagle/eagle3/final \\
        --prompts question --questions /work/shared/data/spec_bench_question.jsonl --per-category 1 \\
        --ngram-min 2 --max-new-tokens 40 --out runs/bench_proposers/ngram_head.json

Both decode with the built-in decoder at temperature 0 (chain drafting), every row on the same prompts, rows
interleaved per prompt (machine-speed drift hits all alike), after a warm-up (8 tokens of the first prompt):

  dynamic  per head: fixed K for every --fixed-ks, and K=--k with drafting.stop_below=<t> for every --stop-below;
           each row's tokens/s over the same head's best fixed K is the figure a deployer reads.
  ngram    per head: the n-gram proposer alone, the head alone, n-gram + head (NgramFirstProposer), per category.

Prints a table and writes JSON (--out): per row tau, mean drafted tokens per cycle, drafter ms per cycle (timed
around update + propose), tokens/s, speedup over target-only, greedy identity; per category for `ngram`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from bench_peagle import TimedProposer

from draftsmith.core.artifacts import atomic_write_json
from draftsmith.configs import compose
from draftsmith.core.machine import machine_info


def prepare_setup(args, k_max: int):
    from draftsmith.eval.run import prepare

    if args.prompts == "holdout":
        prompt_opts = ["prompts.source=holdout", f"prompts.path={args.data}", f"prompts.holdout={args.holdout}",
                       "prompts.n=null"]
    else:
        prompt_opts = ["prompts.source=question", f"prompts.path={args.questions}", "prompts.n=null",
                       f"prompts.per_category={args.per_category}"]
        if args.categories:
            prompt_opts.append(f"prompts.categories=[{','.join(args.categories)}]")
    cfg = compose("eval", [f"target={args.target}", "head=none", *prompt_opts, "temperature=0",
                           f"drafting.num_speculative_tokens={k_max}", f"max_new_tokens={args.max_new_tokens}",
                           f"ngram_min={min(args.ngram_min)}", f"ngram_max={args.ngram_max}",
                           f"out={Path(args.out).with_suffix('')}_eval", "overwrite=true", "progress=false",
                           "plot=false"])
    return cfg, prepare(cfg)


def load_heads(cfg, setup, folders: list[str]) -> dict[str, object]:
    """method name (`eagle3#2` for the second head of a method) -> a fresh proposer of each head folder."""
    from draftsmith.eval.run import load_drafter

    heads = {}
    for folder in folders:
        cfg.head = str(folder)
        drafter = load_drafter(cfg, setup.target, setup.runner.max_len)
        same = sum(1 for name in heads if name.split("#")[0] == drafter.method)
        heads[drafter.method + (f"#{same + 1}" if same else "")] = drafter.make
    cfg.head = "none"
    return heads


def measure(setup, rows: list[tuple], repeats: int, on_prompt=None) -> dict:
    """rows: (name, proposer or None, DraftingConfig). Every prompt by every row, interleaved; per-row totals.
    on_prompt(totals, prompts_done) runs after each prompt (the script writes its JSON there: a run cut short
    keeps the prompts it finished)."""
    from draftsmith.eval.run import decode_conversation

    target, runner, cfg = setup.target, setup.runner, setup.cfg

    def decode(proposer, drafting, prompt, max_new_tokens=cfg.max_new_tokens):
        return decode_conversation(runner, proposer, target.tokenizer, prompt, max_new_tokens, setup.sampling,
                                   drafting, target.eos_token_ids, cfg.seed)

    for prompt in setup.prompts[:1]:  # warm-up: every row once, 8 tokens, nothing recorded
        for _, proposer, drafting in rows:
            decode(proposer, drafting, prompt, 8)
    keys = ("tokens", "seconds", "verifications", "emitted", "drafted", "drafter_s", "cycles", "n", "identical")
    totals = {name: {} for name, _, _ in rows}  # name -> category -> counters
    for done, prompt in enumerate(setup.prompts, 1):
        ref = None
        for rep in range(repeats):
            for name, proposer, drafting in rows:
                if proposer is not None:
                    proposer.seconds, proposer.cycles = 0.0, 0
                    by = getattr(proposer.inner, "drafted_by", None)
                    ngram_before = by["ngram"] if by else 0
                res = decode(proposer, drafting, prompt)[0]  # first turn
                if proposer is None and rep == 0:
                    ref = res.tokens
                t = totals[name].setdefault(prompt.category, dict.fromkeys(keys, 0))
                t.setdefault("times", []).append(res.prefill_s + res.decode_s)
                if rep:
                    continue
                t["tokens"] += len(res.tokens)
                t["verifications"] += res.n_verifications
                t["emitted"] += sum(res.emitted_per_verification)
                t["drafted"] += sum(res.proposed_per_position)  # chains: drafted tokens
                t["n"] += 1
                t["identical"] += int(res.tokens == ref) if ref is not None else 0
                if proposer is not None:
                    t["drafter_s"] += proposer.seconds
                    t["cycles"] += proposer.cycles
                    by = getattr(proposer.inner, "drafted_by", None)
                    if by:  # n-gram + head: the cycles the n-gram side drafted
                        t["ngram_cycles"] = t.get("ngram_cycles") or 0
                        t["ngram_cycles"] += by["ngram"] - ngram_before
        for name in totals:  # each prompt's time: the median of its repeats
            t = totals[name][prompt.category]
            t["seconds"] += _median_pop(t)
        print(f"  prompt {prompt.id} ({prompt.category}) done", flush=True)
        if on_prompt is not None:
            on_prompt(totals, done)
    return totals


def _median_pop(t: dict) -> float:
    times = sorted(t.pop("times"))
    return times[len(times) // 2]


def figures(t: dict, base_tps: float | None) -> dict:
    tps = t["tokens"] / t["seconds"] if t["seconds"] else 0.0
    return {"n": t["n"], "tokens": t["tokens"], "tau": t["emitted"] / max(t["verifications"], 1),
            "drafted_per_cycle": t["drafted"] / max(t["verifications"], 1),
            "drafter_ms_per_cycle": 1000 * t["drafter_s"] / max(t["cycles"], 1),
            "ngram_share_of_cycles": t["ngram_cycles"] / t["cycles"] if "ngram_cycles" in t and t["cycles"] else None,
            "tokens_per_s": tps, "speedup": tps / base_tps if base_tps else None,
            "greedy_identical_fraction": t["identical"] / t["n"] if t["n"] else None}


def merged(per_cat: dict) -> dict:
    out: dict = {}
    for t in per_cat.values():
        for k, v in t.items():
            out[k] = out.get(k, 0) + v
    return out


def bench_dynamic(args):
    from draftsmith.eval.decoder import DraftingConfig

    k_max = max([args.k, *args.fixed_ks])
    cfg, setup = prepare_setup(args, k_max)
    rows = [("target_only", None, DraftingConfig())]
    for method, make in load_heads(cfg, setup, args.heads).items():
        proposer = TimedProposer(make())
        rows += [(f"{method} K={k}", proposer, DraftingConfig("chain", k)) for k in args.fixed_ks]
        rows += [(f"{method} K={args.k} stop_below={t}", proposer, DraftingConfig("chain", args.k, stop_below=t))
                 for t in args.stop_below]
    return rows, setup, lambda totals: dynamic_result(args, rows, totals)


def dynamic_result(args, rows, totals) -> dict:
    base = figures(merged(totals["target_only"]), None)["tokens_per_s"]
    result = {"target_only_tokens_per_s": base, "rows": []}
    for name, _, drafting in rows[1:]:
        r = {"row": name, "method": name.split()[0], "k": drafting.num_speculative_tokens,
             "stop_below": drafting.stop_below, **figures(merged(totals[name]), base)}
        result["rows"].append(r)
    for method in {r["method"] for r in result["rows"]}:
        mine = [r for r in result["rows"] if r["method"] == method]
        best_fixed = max((r for r in mine if r["stop_below"] == 0), key=lambda r: r["tokens_per_s"])
        same_k = next((r for r in mine if r["stop_below"] == 0 and r["k"] == args.k), None)
        for r in mine:
            r["over_best_fixed_k"] = r["tokens_per_s"] / best_fixed["tokens_per_s"]
            r["over_fixed_same_k"] = r["tokens_per_s"] / same_k["tokens_per_s"] if same_k else None
        result.setdefault("best_fixed_k", {})[method] = best_fixed["k"]
    return result


def bench_ngram(args):
    from draftsmith.eval.decoder import DraftingConfig
    from draftsmith.eval.proposers.ngram import NgramFirstProposer, NgramProposer

    cfg, setup = prepare_setup(args, max([args.k, *args.head_ks]))
    drafting = DraftingConfig("chain", args.k)
    stops = [(f" stop_below={t}", DraftingConfig("chain", args.k, stop_below=t)) for t in args.combined_stop_below]
    rows = [("target_only", None, drafting)]
    rows += [(_ngram_name(m, args), TimedProposer(NgramProposer(args.ngram_max, m)), drafting) for m in args.ngram_min]
    for method, make in load_heads(cfg, setup, args.heads).items():
        head = TimedProposer(make())
        rows += [(f"{method} K={k}", head, DraftingConfig("chain", k)) for k in dict.fromkeys([*args.head_ks, args.k])]
        rows += [(f"{method} K={args.k}{name}", head, d) for name, d in stops]
        for m in args.ngram_min:  # n-gram + head: n-gram drafts (one-hot q: never stopped) where it matches
            both = TimedProposer(NgramFirstProposer(NgramProposer(args.ngram_max, m), make()))
            rows += [(f"{_ngram_name(m, args)}+{method} K={args.k}{name}", both, d)
                     for name, d in [("", drafting), *stops]]
    return rows, setup, lambda totals: ngram_result(args, rows, totals)


def _ngram_name(ngram_min: int, args) -> str:
    return "ngram" if len(args.ngram_min) == 1 else f"ngram[{ngram_min}..{args.ngram_max}]"


def ngram_result(args, rows, totals) -> dict:
    base = figures(merged(totals["target_only"]), None)["tokens_per_s"]
    result = {"target_only_tokens_per_s": base, "k": args.k, "rows": []}
    for name, _, _ in rows[1:]:
        per_cat = {c: figures(t, figures(totals["target_only"][c], None)["tokens_per_s"])
                   for c, t in sorted(totals[name].items())}
        result["rows"].append({"row": name, **figures(merged(totals[name]), base), "per_category": per_cat})
    return result


def _identical(fraction) -> str:
    """Flag rows whose greedy output differs from target-only decoding on some prompts. In fp32 that is a bug;
    in bf16 a verify of several tokens rounds differently from a one-token step, so a near-tie can flip
    (`draftsmith eval` reports the share that are near-ties)."""
    return "" if fraction is None or fraction == 1 else f"  greedy identical on {fraction:.0%} of prompts"


def print_table(result: dict, mode: str) -> None:
    print(f"target-only {result['target_only_tokens_per_s']:.2f} tok/s")
    extra = "  vs best fixed K" if mode == "dynamic" else "  n-gram share"
    print(f"{'row':<34} {'tau':>5} {'drafted':>7} {'draft ms':>8} {'tok/s':>6} {'speedup':>7}{extra}")
    for r in result["rows"]:
        tail = (f"  {r['over_best_fixed_k']:.3f}" if mode == "dynamic"
                else f"  {r['ngram_share_of_cycles']:.2f}" if r["ngram_share_of_cycles"] is not None else "")
        print(f"{r['row']:<34} {r['tau']:5.2f} {r['drafted_per_cycle']:7.2f} {r['drafter_ms_per_cycle']:8.1f} "
              f"{r['tokens_per_s']:6.2f} {r['speedup']:6.3f}x{tail}" + _identical(r["greedy_identical_fraction"]))
        if mode == "ngram":
            for c, f in r["per_category"].items():
                print(f"    {c:<30} {f['tau']:5.2f} {f['drafted_per_cycle']:7.2f} {f['drafter_ms_per_cycle']:8.1f} "
                      f"{f['tokens_per_s']:6.2f} {f['speedup']:6.3f}x"
                      + (f"  {f['ngram_share_of_cycles']:.2f}" if f["ngram_share_of_cycles"] is not None else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("dynamic", "ngram"))
    ap.add_argument("--heads", nargs="+", required=True, help="head folders (EAGLE-3, P-EAGLE, draft model)")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", choices=("holdout", "question"), default="holdout")
    ap.add_argument("--data", help="--prompts holdout: a data-gen output")
    ap.add_argument("--holdout", type=int, default=6)
    ap.add_argument("--questions", help="--prompts question: a Spec-Bench / MT-bench question.jsonl")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--categories", nargs="*", default=None)
    ap.add_argument("--k", type=int, default=5, help="chain length (dynamic: the cap with stop_below)")
    ap.add_argument("--fixed-ks", type=int, nargs="+", default=[1, 2, 3, 5])
    ap.add_argument("--stop-below", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    ap.add_argument("--ngram-min", type=int, nargs="+", default=[2],
                    help="shortest suffix match; ngram: a row (and an n-gram + head row) for each")
    ap.add_argument("--head-ks", type=int, nargs="*", default=[], help="ngram: the head alone also at these K")
    ap.add_argument("--combined-stop-below", type=float, nargs="*", default=[],
                    help="ngram: the head alone and n-gram + head also with drafting.stop_below=<t> (n-gram's one-hot "
                         "drafts never stop)")
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", required=True, help="the JSON file to write")
    args = ap.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    rows, setup, summarize = (bench_dynamic if args.mode == "dynamic" else bench_ngram)(args)

    def write(totals, done):
        result = {"mode": args.mode, "settings": vars(args), "temperature": 0, "drafting": "chain",
                  "n_prompts": done, "complete": done == len(setup.prompts), "warmup_prompt": setup.prompts[0].id,
                  "prompt_ids": [p.id for p in setup.prompts[:done]], **summarize(totals),
                  "seconds": round(time.perf_counter() - t0, 1)}
        result["machine"] = machine_info()  # CPU kind, vector features, bf16, threads: beside every figure
        atomic_write_json(Path(args.out), result)
        return result

    totals = measure(setup, rows, args.repeats, write)
    result = write(totals, len(setup.prompts))
    print(f"{args.mode}: T=0, chain, {result['n_prompts']} prompts (the first also decoded once, 8 tokens, as "
          f"warm-up), max_new_tokens={args.max_new_tokens}")
    print_table(result, args.mode)
    print(f"wrote {args.out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
