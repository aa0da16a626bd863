"""Benchmark: EAGLE-3 head quality at an equal training budget, draftsmith beside its peers (not a test).

    python benchmarks/bench_vs_peers.py --data runs/demo/data --out runs/vs_peers --budget-s 240 \
        [--holdout 16] [--spec-bench-n 16] [--ks 3 7] [--engine vllm] [--peers speculators specforge] \
        [--variant ttt3:method.ttt_steps=3 --variant nodecay:method.ttt_decay=1.0 ...] [--equal-samples]

One data-gen output of the embedded target (self-written prompts, hidden states) feeds every trainer:
  held-out       its last `--holdout` rows are never trained on (draftsmith: val_samples; the peers get the
                 rows before them); a second held-out set is `--spec-bench-n` Spec-Bench questions (at most 2
                 per category), which no data-gen ever saw
  draftsmith     `draftsmith train method=eagle3` offline, its defaults (and each `--variant`'s overrides): a
                 short calibration run measures seconds per step, then as many steps as fit in `--budget-s`
                 (its cosine schedule ends on the budget)
  speculators    vLLM's speculators 0.9 EAGLE-3 trainer on the same rows, converted to its format, on CPU with the
                 documented patches of benchmarks/peers/speculators_eagle3.py, its own recipe's defaults, for the
                 same wall-clock; its head converted to a folder draftsmith evaluates (peer not installed: said)
  SpecForge      SpecForge 0.2.0's own EAGLE-3 model, loss and optimizer with its defaults (lr 1e-4, TTT 7, 0.8^i
                 per-step weights, AdamW + cosine, random lm_head), driven one row per step by
                 benchmarks/peers/specforge_eagle3.py in SpecForge's venv (../shared/peers/setup_specforge.sh) on the
                 same rows converted, for the same wall-clock; its head saved as a draftsmith EAGLE-3 folder
Every head is evaluated by `draftsmith eval` on both held-out sets at T = 0, chain, each K of `--ks` (fp32):
the built-in decoder, and vLLM for CPU with `--engine vllm` (its τ is the one that counts). Prints per head,
set and K the τ (and the ratio draftsmith / peer), and writes `<out>/bench_vs_peers.json` with the machine.

--equal-samples adds the second reading: draftsmith trained for each peer's samples seen, and each peer for
draftsmith's (the wall-clock then differs; not run for a peer that saw within 10 % of draftsmith's samples).
A peer whose run fails is said in the table; the others still run.

Resumable: a stage whose `<folder>/done.json` holds the same overrides is not run again. Run it alone: two
processes on these cores make torch's threads spin and the budgets stop being equal.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from draftsmith.core.artifacts import atomic_write_json
from draftsmith.configs import compose
from draftsmith.eval.run import run as eval_run
from draftsmith.core.machine import machine_info
from draftsmith.train.run import run as train_run

ROOT = Path(__file__).resolve().parents[1]
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench_question.jsonl"
PEER_SPECULATORS = ROOT / "benchmarks" / "peers" / "speculators_eagle3.py"
PEER_SPECFORGE = ROOT / "benchmarks" / "peers" / "specforge_eagle3.py"
SPECFORGE_VENV = Path(os.environ.get("PEERS_HOME", Path.home() / ".cache" / "draftsmith-peers")) / "specforge-venv"


def done_or_run(folder: Path, overrides: list[str], fn) -> dict:
    """fn() unless folder/done.json holds these overrides (then its recorded result)."""
    stamp = folder / "done.json"
    if stamp.is_file():
        rec = json.loads(stamp.read_text())
        if rec.get("overrides") == overrides:
            return rec["result"]
    t0 = time.perf_counter()
    result = fn()
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(stamp, {"overrides": overrides, "result": result, "seconds": round(time.perf_counter() - t0, 1)})
    return result


def n_rows(data: Path) -> int:
    return int(json.loads((data / "manifest.json").read_text())["counts"]["samples"])


# --------------------------------------------------------------------------- draftsmith

def draftsmith_overrides(args, out: Path, steps: int, extra: list[str]) -> list[str]:
    return ["method=eagle3", "target=smollm2", f"data={args.data}", f"out={out}", f"max_steps={steps}", "mode=offline",
            f"val_samples={args.holdout}", f"micro_batch_size={args.micro_batch_size}", f"max_length={args.max_length}",
            f"lr={args.lr}", f"method.draft_vocab_size={args.draft_vocab_size}", f"seed={args.seed}",
            "precision=fp32", "deepspeed=none", "progress=false", "wandb.mode=disabled", "overwrite=true",
            "save_every=100000", *extra]


def mean_step_s(out: Path, skip: int) -> float:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step_s" in r][skip:]
    return sum(r["step_s"] for r in rows) / len(rows)


def train_draftsmith(args, name: str, extra: list[str], steps: int | None = None) -> dict:
    """Calibrate seconds per step, then train for as many steps as fit in the budget (or exactly `steps`: the
    equal-samples reading)."""
    s_per_step = None
    if steps is None:
        calib = args.out / name / "calibration"
        train_run(compose("train", draftsmith_overrides(args, calib, args.calib_steps, extra)))
        s_per_step = mean_step_s(calib, skip=2)
        steps = max(1, int(args.budget_s / s_per_step))
    out = args.out / name / "train"
    t0 = time.perf_counter()
    result = train_run(compose("train", draftsmith_overrides(args, out, steps, extra)))
    wall = time.perf_counter() - t0
    print(f"[{name}] {steps} steps in {wall:.0f} s", flush=True)
    return {"head": str(result["final"]), "steps": steps, "samples_seen": steps * args.micro_batch_size,
            "train_wall_s": round(wall, 1), "train_step_s": round(mean_step_s(out, skip=0), 4),
            "calibrated_s_per_step": round(s_per_step, 4) if s_per_step else None, "overrides": extra}


# --------------------------------------------------------------------------- peers

def peer_train(args, out: Path, extra: list[str], passthrough: list[str]) -> dict:
    """One run of benchmarks/peers/speculators_eagle3.py train; its record."""
    rec = out / "peer.json"
    cmd = [sys.executable, str(PEER_SPECULATORS), "train", "--data", str(args.data), "--out", str(out),
           "--samples", str(n_rows(args.data) - args.holdout), "--val-samples", "1",
           "--draft-vocab-size", str(args.draft_vocab_size), "--total-seq-len", str(args.peer_total_seq_len),
           "--seed", str(args.seed), "--precision", "fp32", "--json", str(rec), *extra]
    if passthrough:
        cmd += ["--", *passthrough]
    print("[speculators]", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(rec.read_text())


def train_speculators(args, name: str = "speculators", samples: int | None = None) -> dict:
    """speculators' EAGLE-3 trainer, its recipe's defaults, on the rows draftsmith trains on: a calibration run
    measures its seconds per step and samples per step, then its LR schedule is set to end on the budget (as
    draftsmith's) and the budget stops it; or, with `samples` (the equal-samples reading), to end after that many
    samples, which stop it. Its validation row is the first held-out row (never trained on)."""
    calib_cmd = ["--max-steps", str(args.peer_calib_steps)]
    calib = done_or_run(args.out / "speculators" / "calibration_record", calib_cmd,
                        lambda: peer_train(args, args.out / "speculators" / "calibration", calib_cmd, []))
    s_per_step = calib["train_wall_s"] / max(calib["steps"], 1)
    if samples is None:
        steps = max(1, int(args.budget_s / s_per_step))
        stop = ["--budget-s", str(args.budget_s)]
    else:
        steps = max(1, round(samples / (calib["samples_seen"] / max(calib["steps"], 1))))
        stop = ["--max-samples", str(samples)]
    peer = peer_train(args, args.out / name / "run", stop, ["--scheduler-total-steps", str(steps)])
    print(f"[{name}] {peer.get('steps')} steps ({s_per_step:.2f} s/step calibrated, schedule {steps} steps), "
          f"{peer.get('samples_seen')} samples in {peer.get('train_wall_s')} s", flush=True)
    return {"head": str(args.out / name / "run" / "head"), "steps": peer.get("steps"),
            "samples_seen": peer.get("samples_seen"), "train_wall_s": peer.get("train_wall_s"),
            "calibrated_s_per_step": round(s_per_step, 3), "schedule_steps": steps, "record": peer}


def specforge_run(args, out: Path, stop: list[str], total_steps: int) -> dict:
    """One run of benchmarks/peers/specforge_eagle3.py in SpecForge's venv on the converted rows; its record."""
    from draftsmith.data_gen.target import TargetConfig, load_target
    from draftsmith.core.engine import served_folder

    target = load_target(TargetConfig(name="smollm2"), lazy=True)
    rec = out / "peer.json"
    cmd = [str(SPECFORGE_VENV / "bin" / "python"), str(PEER_SPECFORGE), "--data", str(specforge_data(args)),
           "--target", served_folder(target, "the SpecForge peer"), "--out", str(out / "head"),
           "--total-steps", str(total_steps), "--draft-vocab-size", str(args.draft_vocab_size),
           "--seed", str(args.seed), "--json", str(rec), *stop]
    if out.exists():  # a run cut off earlier: this script's own folder
        shutil.rmtree(out)
    out.mkdir(parents=True)
    print("[specforge]", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    record = json.loads(rec.read_text())
    # the head as a draftsmith EAGLE-3 folder (manifest: the target), which `draftsmith eval` reads
    from draftsmith.heads.eagle3_folders import load_eagle3, save_eagle3

    save_eagle3(load_eagle3(out / "head"), out / "head_draftsmith", manifest_target=target.identity(), stage="export")
    record["head_draftsmith"] = str(out / "head_draftsmith")
    return record


def specforge_data(args) -> Path:
    """The rows draftsmith trains on in the offline format both peers read (speculators_eagle3.py convert)."""
    folder = args.out / "specforge" / "data"
    done_or_run(args.out / "specforge" / "data_record", [str(args.data), str(args.holdout)], lambda: subprocess.run(
        [sys.executable, str(PEER_SPECULATORS), "convert", "--data", str(args.data), "--out", str(folder),
         "--samples", str(n_rows(args.data) - args.holdout), "--val-samples", "1"], check=True).returncode)
    return folder


def train_specforge(args, name: str = "specforge", samples: int | None = None) -> dict:
    """SpecForge 0.2.0's EAGLE-3 model, loss and optimizer with its defaults (lr 1e-4, TTT 7, 0.8^i, cosine), one
    row per step: a calibration run measures seconds per step, then the schedule ends on the budget (or on
    `samples`, the equal-samples reading) and that stops it."""
    calib = done_or_run(args.out / "specforge" / "calibration_record", ["max_steps=8"],
                        lambda: specforge_run(args, args.out / "specforge" / "calibration", ["--max-steps", "8"], 8))
    s_per_step = calib.get("s_per_step_after_2") or calib["train_wall_s"] / calib["steps"]
    if samples is None:
        steps, stop = max(1, int(args.budget_s / s_per_step)), ["--budget-s", str(args.budget_s)]
    else:
        steps, stop = samples, ["--max-samples", str(samples)]
    peer = specforge_run(args, args.out / name / "run", stop, steps)
    print(f"[{name}] {peer['steps']} steps ({s_per_step:.3f} s/step calibrated, schedule {steps} steps) in "
          f"{peer['train_wall_s']} s", flush=True)
    return {"head": peer["head_draftsmith"], "steps": peer["steps"], "samples_seen": peer["samples_seen"],
            "train_wall_s": peer["train_wall_s"], "calibrated_s_per_step": round(s_per_step, 4),
            "schedule_steps": steps, "record": peer}


def specforge_missing() -> str | None:
    if not (SPECFORGE_VENV / "bin" / "python").is_file():
        return f"peer not installed (no SpecForge venv at {SPECFORGE_VENV}: bash ../shared/peers/setup_specforge.sh)"
    return None


def speculators_missing() -> str | None:
    try:
        import speculators  # noqa: F401
    except ImportError as e:
        return f"peer not installed (speculators: {e})"
    if not PEER_SPECULATORS.is_file():
        return f"peer runner missing ({PEER_SPECULATORS})"
    return None


# each peer: (why it cannot run, or None; its training run at the budget or at `samples`)
PEERS = {"speculators": (speculators_missing, train_speculators), "specforge": (specforge_missing, train_specforge)}


# --------------------------------------------------------------------------- evaluation

def eval_sets(args) -> dict[str, list[str]]:
    return {"self": ["prompts.source=holdout", f"prompts.path={args.data}", f"prompts.holdout={args.holdout}",
                     "prompts.n=null"],
            "spec_bench": ["prompts.source=question", f"prompts.path={args.spec_bench}", "prompts.per_category=2",
                           f"prompts.n={args.spec_bench_n}"]}


def evaluate(args, name: str, head: str, engine: str) -> dict:
    """τ per set and K: the built-in decoder's and (engine=vllm) vLLM's. A speculators head is evaluated through
    the peer script, which registers its head type (EAGLE-3 with the EAGLE-3.1 norms) in draftsmith's table."""
    out = {}
    for set_name, prompt_args in eval_sets(args).items():
        overrides = ["target=smollm2", "target.dtype=float32", f"head={head}", *prompt_args, "temperature=0",
                     "drafting.mode=chain", f"drafting.num_speculative_tokens={args.ks[0]}",
                     f"sweep_k=[{','.join(map(str, args.ks))}]", f"max_new_tokens={args.max_new_tokens}",
                     "repeats=1", "baselines=[]", f"engine={engine}", "progress=false", "plot=false",
                     f"out={args.out / name / f'eval_{set_name}'}", "overwrite=true"]
        if name.startswith("speculators"):
            subprocess.run([sys.executable, str(PEER_SPECULATORS), "eval", "--head", head, *overrides], check=True)
            report = json.loads((args.out / name / f"eval_{set_name}" / "report.json").read_text())
        else:
            report = eval_run(compose("eval", overrides))
        out[set_name] = per_k(report, args.ks)
    return out


def per_k(report: dict, ks: list[int]) -> dict:
    """{K: τ and per-position acceptance, built-in and vLLM} from one eval report with a K sweep."""
    sweep = {row["k"]: row for row in report.get("k_sweep", [])}
    method = report["method"]
    engine_runs = (report.get("engine") or {}).get("runs", {})
    rows = {}
    for k in ks:
        row = sweep.get(k, {})
        run = next((r for n, r in engine_runs.items()
                    if r.get("k") == k and r.get("loaded") and (n == method or n.startswith(f"{method}@"))), None)
        rows[str(k)] = {"tau_builtin": row.get("tau"), "per_position_builtin": row.get("per_position_acceptance"),
                   "tau_vllm": run["tau"] if run else None,
                   "per_position_vllm": run["per_position_acceptance"] if run else None}
    return rows


# --------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True, help="a SmolLM2 data-gen output with hidden states")
    ap.add_argument("--out", type=Path, default=Path("runs/vs_peers"))
    ap.add_argument("--budget-s", type=float, default=240.0, help="training wall seconds of every trainer")
    ap.add_argument("--calib-steps", type=int, default=8)
    ap.add_argument("--holdout", type=int, default=16, help="last rows of --data: never trained on, evaluated")
    ap.add_argument("--spec-bench", type=Path, default=SPEC_BENCH)
    ap.add_argument("--spec-bench-n", type=int, default=16)
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--engine", choices=["builtin", "vllm"], default="vllm")
    ap.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME:override[,override...]: another draftsmith run at the same budget (an ablation)")
    ap.add_argument("--peer-total-seq-len", type=int, default=8192, help="speculators: tokens packed per step "
                    "(its default 8192)")
    ap.add_argument("--peer-calib-steps", type=int, default=4)
    ap.add_argument("--equal-samples", action="store_true",
                    help="the second reading: draftsmith trained for the peer's samples seen, and the peer for "
                         "draftsmith's (each with its schedule ending there; wall-clock not equal)")
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not (args.data / "manifest.json").is_file():
        print(f"--data {args.data}: not a data-gen output (no manifest.json).", file=sys.stderr)
        return 2
    if args.holdout >= n_rows(args.data):
        print(f"--holdout {args.holdout}: {args.data} has only {n_rows(args.data)} rows.", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs: dict[str, dict] = {}
    trainers = [("draftsmith", []), *[(v.split(":", 1)[0], v.split(":", 1)[1].split(",")) for v in args.variant]]
    for name, extra in trainers:
        key = [f"budget_s={args.budget_s}", *extra]
        runs[name] = done_or_run(args.out / name, key, functools.partial(train_draftsmith, args, name, extra))
    for peer in args.peers:
        is_missing, train_peer = PEERS[peer]
        missing = is_missing()
        if missing:
            runs[peer] = {"missing": missing}
            continue
        try:
            runs[peer] = done_or_run(args.out / peer, [f"budget_s={args.budget_s}"],
                                     functools.partial(train_peer, args))
        except subprocess.CalledProcessError as e:  # said in the table, and the other heads are still evaluated
            print(f"[{peer}] FAILED: {e}", flush=True)
            runs[peer] = {"missing": f"peer run failed ({e})"}
            continue
        theirs, ours = runs[peer]["samples_seen"], runs["draftsmith"]["samples_seen"]
        if args.equal_samples and abs(theirs - ours) > 0.1 * ours:  # within 10 %: the budget reading is that one
            name = f"draftsmith@{peer}_samples"
            runs[name] = done_or_run(args.out / name, [f"samples={theirs}"],
                                     functools.partial(train_draftsmith, args, name, [],
                                                       steps=theirs // args.micro_batch_size))
            name = f"{peer}@draftsmith_samples"
            runs[name] = done_or_run(args.out / name, [f"samples={ours}"],
                                     functools.partial(train_peer, args, name, samples=ours))
    for name, run in runs.items():
        if "head" in run:
            # vLLM (the figure that counts) for the two heads of the goal, draftsmith's and the peer's at the same
            # budget (vLLM reads the peer's speculators folder, EAGLE-3.1 norms included); built-in for the rest
            engine = args.engine if name in ("draftsmith", *args.peers) else "builtin"
            run["tau"] = done_or_run(args.out / name / "eval", [engine, *map(str, args.ks)],
                                     functools.partial(evaluate, args, name, run["head"], engine))
    result = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "runs": runs,
              "seconds": round(time.perf_counter() - t0, 1), "machine": machine_info()}
    atomic_write_json(args.out / "bench_vs_peers.json", result)
    print_table(result, args)
    print(f"wrote {args.out / 'bench_vs_peers.json'}")
    return 0


def print_table(result: dict, args) -> None:
    ours = result["runs"]["draftsmith"].get("tau", {})
    print(f"\nT = 0, chain, fp32; training budget {args.budget_s:.0f} s each; held-out: {args.holdout} self-written, "
          f"{args.spec_bench_n} Spec-Bench; {result['machine'].get('cpu', '?')} "
          f"({result['machine'].get('cpu_vector', '?')})")
    print(f"{'head':<28} {'steps':>6} {'samples':>7} {'set':<10} {'K':>2} {'tau built-in':>12} {'tau vLLM':>9} "
          f"{'draftsmith / this (built-in)':>28} {'(vLLM)':>7}")

    def ratio(base, ref):
        return f"{base / ref:.3f}" if base and ref else "-"

    for name, run in result["runs"].items():
        if "missing" in run:
            print(f"{name:<28} {run['missing']}")
            continue
        for set_name, per in (run.get("tau") or {}).items():
            for k, t in per.items():
                mine = (ours.get(set_name) or {}).get(k) or {}
                # like with like: the built-in decoder's τ on both sides, and vLLM's where both heads ran there
                same = name == "draftsmith"
                print(f"{name:<28} {run.get('steps', '-'):>6} {run.get('samples_seen', '-'):>7} {set_name:<10} {k:>2} "
                      f"{t.get('tau_builtin') or float('nan'):12.3f} {t.get('tau_vllm') or float('nan'):9.3f} "
                      f"{'-' if same else ratio(mine.get('tau_builtin'), t.get('tau_builtin')):>28} "
                      f"{'-' if same else ratio(mine.get('tau_vllm'), t.get('tau_vllm')):>7}")


if __name__ == "__main__":
    sys.exit(main())
