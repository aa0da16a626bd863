"""Benchmark: a learning curve of EAGLE-3 heads against the amount of self-generated data (not a test).

    nice python benchmarks/bench_learning_curve.py --out runs/curve --samples 80 240 720
        [--variants plain filtered mix mix_filtered] [--ks 3 7] [--heldout 16] [--spec-bench-n 16]
        [--target smollm2] [--gen-max-new-tokens 128] [--epochs 2] [--mode offline] [--eval-max-new-tokens 64]

For every variant (how the training data is made), under `<out>/<variant>/`:
  data/                 one `draftsmith data-gen prompts=self` (+ the variant's options) of max(--samples)
                        prompts, with hidden states for offline training; at the default 128 new tokens a
                        self-written sample is ~180 tokens, so 80 / 240 / 720 samples are ~15 k / 45 k / 130 k
  p<N>/head/            `draftsmith train method=eagle3 train_samples=N`: the first N samples (so the points
                        are nested: each adds data to the one before), --epochs passes, no rows held out
  p<N>/eval_<set>_k<K>/ `draftsmith eval` temperature 0, chain drafting K, the built-in decoder, on two
                        held-out sets: `self` (self-written prompts of another seed, unsteered and
                        unfiltered: `<out>/heldout/data`, made once) and `spec_bench` (Spec-Bench questions,
                        at most 2 per category; evaluation only, never trained on)
Each stage is skipped when `<stage>.done.json` in its folder holds the same overrides; an interrupted
data-gen resumes its chunks and an interrupted training its latest checkpoint, so the script is
resumable: rerun the same command (or add points / variants).

Writes `<out>/learning_curve.json` (one row per variant, point, set and K: training samples and tokens,
training seconds, what the filters dropped, tau, per-position acceptance, speedup against target-only
decoding and the break-even tau = tau / speedup, the tau at which this head's drafting cost is just paid
for), `<out>/learning_curve.md` (the table) and `<out>/learning_curve.png` (tau against training tokens, one
panel per held-out set, the break-even taus dashed). Variants: plain (unsteered, unfiltered: the default
data-gen), filtered (filters.prompts and filters.answers on), mix (prompts=self_mix: steered across task
kinds) and mix_filtered. A filtered variant may keep fewer samples than asked: its larger points are cut
to what it kept.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from draftsmith.core.machine import machine_info
from draftsmith.core.artifacts import atomic_write_bytes, atomic_write_json

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_question.jsonl"
VARIANTS = {
    "plain": [],
    "filtered": ["filters.prompts=true", "filters.answers=true"],
    "mix": ["prompts=self_mix"],
    "mix_filtered": ["prompts=self_mix", "filters.prompts=true", "filters.answers=true"],
}


def run_stage(stage: str, overrides: list[str]) -> dict:
    from importlib import import_module

    from draftsmith.configs import compose

    module = {"data_gen": "draftsmith.data_gen.run", "train": "draftsmith.train.run", "eval": "draftsmith.eval.run"}
    return import_module(module[stage]).run(compose(stage, overrides))


def stage(folder: Path, name: str, overrides: list[str], log: list) -> bool:
    """Run a stage unless `folder/<name>.done.json` holds these overrides; True when it ran."""
    stamp = folder / f"{name}.done.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("overrides") == overrides:
        return False
    args = list(overrides)
    if name == "train":
        from draftsmith.train.checkpoint import list_checkpoints

        if list_checkpoints(folder / "head"):  # an interrupted training: go on from its latest checkpoint
            args.append("resume=true")
    print(f"learning curve: {name} -> {folder}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    run_stage(name.split(".")[0], args)
    seconds = round(time.perf_counter() - t0, 1)
    log.append({"folder": str(folder), "stage": name, "seconds": seconds})
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(stamp, {"overrides": overrides, "seconds": seconds})
    return True


def heldout_self(args, log: list) -> Path:
    """Self-written prompts of another seed (plain), apart from the training sets; answers of 1 token
    (eval decodes the prompts only)."""
    folder = args.out / "heldout"
    stage(folder, "data_gen", [f"target={args.target}", "prompts=self", f"prompts.n={args.heldout + 1}",
                               f"prompts.seed={args.seed + 1000}", f"prompts.max_prompt_tokens={args.max_prompt_tokens}",
                               "max_new_tokens=1", f"target.dtype={args.gen_dtype}", f"out={folder / 'data'}",
                               "overwrite=true"], log)
    return folder / "data"


def variant_data(args, variant: str, log: list) -> Path:
    """One data-gen of max(--samples) prompts for the variant (hidden states too for offline training)."""
    folder = args.out / variant
    # steered prompts carry a passage to summarise or extract from: they get twice the room
    prompt_tokens = args.max_prompt_tokens * (2 if "prompts=self_mix" in VARIANTS[variant] else 1)
    stage(folder, "data_gen", [f"target={args.target}", *VARIANTS[variant], f"prompts.n={max(args.samples)}",
                               f"prompts.seed={args.seed}", f"prompts.max_prompt_tokens={prompt_tokens}",
                               f"seed={args.seed}", f"max_new_tokens={args.gen_max_new_tokens}",
                               f"hidden_states={str(args.mode == 'offline').lower()}",
                               f"backend.batch_size={args.gen_batch_size}", f"regenerate_chunk={4 * args.gen_batch_size}",
                               f"target.dtype={args.gen_dtype}", f"out={folder / 'data'}", "overwrite=true"], log)
    return folder / "data"


def point(args, variant: str, data: Path, n: int, heldout: Path, log: list) -> list[dict]:
    """Train on the first n samples of the variant's data and eval; the point's rows."""
    folder = args.out / variant / f"p{n}"
    target = f"target={args.target}"
    stage(folder, "train", ["method=eagle3", target, f"data={data}", f"out={folder / 'head'}",
                                  f"mode={args.mode}", "deepspeed=none", f"train_samples={n}", f"epochs={args.epochs}",
                                  f"lr={args.lr}", "warmup_ratio=0.05", f"method.draft_vocab_size={args.draft_vocab_size}",
                                  f"max_length={args.max_length}", f"micro_batch_size={args.micro_batch_size}",
                                  f"precision={args.precision}", f"seed={args.seed}", "wandb.mode=disabled",
                                  "progress=false", "save_every=200", "overwrite=true"], log)
    train_seconds = json.loads((folder / "train.done.json").read_text())["seconds"]
    sets = {"self": ["prompts.source=holdout", f"prompts.path={heldout}", f"prompts.holdout={args.heldout}",
                     "prompts.n=null"],
            "spec_bench": ["prompts.source=question", f"prompts.path={args.spec_bench}", "prompts.per_category=2",
                           f"prompts.n={args.spec_bench_n}"]}
    manifest = json.loads((data / "manifest.json").read_text())
    tokens, loss_tokens = _prefix_tokens(data, n)
    train_prompts = _prompt_texts(data, n)
    rows = []
    for set_name, prompt_args in sets.items():
        for k in args.ks:
            if set_name == "spec_bench" and k not in args.spec_bench_ks:
                continue
            ev = folder / f"eval_{set_name}_k{k}"
            stage(folder, f"eval.{set_name}.k{k}", [target, f"head={folder / 'head' / 'final'}", *prompt_args,
                                                    "temperature=0", "drafting.mode=chain",
                                                    f"drafting.num_speculative_tokens={k}",
                                                    f"max_new_tokens={args.eval_max_new_tokens}",
                                                    f"repeats={args.repeats}", f"seed={args.seed}", "progress=false",
                                                    "baselines=[ngram]",
                                                    "plot=false", f"out={ev}", "overwrite=true"], log)
            r = json.loads((ev / "report.json").read_text())
            rows.append({
                "variant": variant, "samples": n, "set": set_name, "k": k,
                "train_samples": n, "train_tokens": tokens, "train_loss_tokens": loss_tokens,
                "train_seconds": train_seconds, "epochs": args.epochs, "mode": args.mode,
                "filtered": {c: v for c, v in manifest["counts"].items() if c.startswith("filtered_")},
                "eval_prompts": r["n_prompts"], "tau": r["tau"], "speedup": r["speedup"],
                "break_even_tau": r["tau"] / r["speedup"] if r["speedup"] else None,
                "per_position_acceptance": r["per_position_acceptance"],
                "speculative_tokens_per_s": r["speculative_tokens_per_s"],
                "target_only_tokens_per_s": r["target_only_tokens_per_s"],
                "ngram": r.get("baselines", {}).get("ngram"),
                "heldout_in_training": (len(_prompt_texts(heldout) & train_prompts) if set_name == "self" else 0),
            })
    return rows


def _row_key(row: dict) -> tuple:
    return row["variant"], row["samples"], row["set"], row["k"]


def _prefix_tokens(data: Path, n: int) -> tuple[int, int]:
    """(tokens, loss tokens) of the first n tokenized samples: what train_samples=n trains on."""
    from datasets import load_from_disk

    rows = load_from_disk(str(data / "tokenized"))[:n]
    return sum(map(len, rows["input_ids"])), sum(map(sum, rows["loss_mask"]))


def _prompt_texts(data: Path, n: int | None = None) -> set[str]:
    """The first user turn of the first n conversations (all: None) of a data-gen output (for the held-out
    overlap check)."""
    from draftsmith.data_gen.dataset import load_conversations

    conversations = load_conversations(data)
    if n is not None:
        conversations = conversations.select(range(min(n, len(conversations))))
    return {next(m["content"] for m in c["messages"] if m["role"] == "user") for c in conversations}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = sorted({r["set"] for r in rows}, key=lambda s: s != "self")
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4.5), squeeze=False)
    for ax, set_name in zip(axes[0], sets):
        mine = [r for r in rows if r["set"] == set_name]
        ks = sorted({r["k"] for r in mine})
        variants = sorted({r["variant"] for r in mine}, key=lambda v: (v != "plain", v))  # plain first: C0
        for c, variant in enumerate(variants):  # colour: variant; marker and line style: K
            for j, k in enumerate(ks):
                line = sorted((r for r in mine if r["variant"] == variant and r["k"] == k), key=lambda r: r["train_tokens"])
                if line:
                    ax.plot([r["train_tokens"] for r in line], [r["tau"] for r in line], color=f"C{c}",
                            marker="os^vD"[j % 5], linestyle=["-", "-."][j % 2], label=f"{variant} K={k}")
        for j, k in enumerate(ks):
            # The drafting cost does not depend on the data a head saw: one break-even line per K (the median
            # over every head of this set), and the tau at which a head would be as fast as n-gram lookup on
            # the same prompts (n-gram's speedup x break-even tau).
            at_k = [r for r in mine if r["k"] == k and r["break_even_tau"]]
            be = sorted(r["break_even_tau"] for r in at_k)
            ng = sorted(r["ngram"]["speedup"] * r["break_even_tau"] for r in at_k if r.get("ngram"))
            if be:
                ax.axhline(be[len(be) // 2], color="black", linestyle=["--", ":"][j % 2], linewidth=1,
                           label=f"K={k} break-even")
            if ng:
                ax.axhline(ng[len(ng) // 2], color="grey", linestyle=["--", ":"][j % 2], linewidth=1,
                           label=f"K={k}: tau to match n-gram's speed")
        ax.set_xscale("log")
        ax.set_xlabel("training tokens (self-generated)")
        ax.set_ylabel("tau (T=0, chain)")
        ax.set_title(f"held-out: {set_name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def table(rows: list[dict]) -> str:
    lines = ["| variant | train samples | train tokens | train s | set | K | tau | speedup | break-even tau "
             "| n-gram tau | n-gram speedup |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        be = f"{r['break_even_tau']:.2f}" if r["break_even_tau"] else "n/a"
        ng = r.get("ngram") or {}
        ng_tau = f"{ng['tau']:.3f}" if "tau" in ng else "n/a"
        ng_speed = f"{ng['speedup']:.3f}" if "speedup" in ng else "n/a"
        lines.append(f"| {r['variant']} | {r['train_samples']} | {r['train_tokens']} | {r['train_seconds']:.0f} | "
                     f"{r['set']} | {r['k']} | {r['tau']:.3f} | {r['speedup']:.3f} | {be} | {ng_tau} | {ng_speed} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/curve"))
    ap.add_argument("--samples", type=int, nargs="+", default=[80, 240, 720],
                    help="training samples of each point (~180 tokens each at --gen-max-new-tokens 128)")
    ap.add_argument("--variants", nargs="+", default=["plain"], choices=list(VARIANTS))
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--spec-bench-ks", type=int, nargs="+", default=[3], help="the Ks also run on Spec-Bench")
    ap.add_argument("--mode", default="offline", choices=["online", "offline"], help="training mode")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout", type=int, default=16, help="held-out self-written prompts")
    ap.add_argument("--spec-bench", type=Path, default=SPEC_BENCH, help="Spec-Bench question.jsonl (eval only)")
    ap.add_argument("--spec-bench-n", type=int, default=16, help="Spec-Bench questions (at most 2 per category)")
    ap.add_argument("--max-prompt-tokens", type=int, default=64, help="self-written prompt cap (mix: twice this)")
    ap.add_argument("--gen-max-new-tokens", type=int, default=128)
    ap.add_argument("--gen-dtype", default="bfloat16")
    ap.add_argument("--gen-batch-size", type=int, default=32, help="data-gen's backend.batch_size")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--max-length", type=int, default=384)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--eval-max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    if not args.spec_bench.is_file():
        print(f"--spec-bench {args.spec_bench}: no such file.", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    log: list = []
    t0 = time.perf_counter()
    heldout = heldout_self(args, log)
    # rows of earlier runs into the same --out (other variants or points) stay in the table
    previous = args.out / "learning_curve.json"
    kept_rows = json.loads(previous.read_text())["rows"] if previous.is_file() else []
    rows = []
    for variant in args.variants:
        data = variant_data(args, variant, log)
        kept = json.loads((data / "manifest.json").read_text())["counts"]["samples"]
        points = sorted({min(n, kept) for n in args.samples})
        if points != sorted(args.samples):
            print(f"learning curve: {variant} kept {kept} samples; points {points}", file=sys.stderr, flush=True)
        for n in points:
            rows += point(args, variant, data, n, heldout, log)
            new = {_row_key(r) for r in rows}
            merged = sorted([r for r in kept_rows if _row_key(r) not in new] + rows, key=_row_key)
            # written after every point: a long run that is stopped still leaves its finished points
            result = {"target": args.target, "rows": merged, "ran": log, "seconds": round(time.perf_counter() - t0, 1),
                      "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
            result["machine"] = machine_info()  # CPU kind, vector features, bf16, threads: beside every figure
            atomic_write_json(args.out / "learning_curve.json", result)
            plot(merged, args.out / "learning_curve.png")
            text = table(merged)
            atomic_write_bytes(args.out / "learning_curve.md", (text + "\n").encode())
    print(text)
    print(f"-> {args.out / 'learning_curve.json'}, {args.out / 'learning_curve.png'} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
