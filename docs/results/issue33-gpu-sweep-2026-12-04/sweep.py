"""Issue 33 GPU sweep: how the demo's EAGLE-3 head's tau depends on (training samples, epochs), draft vocab and
TTT steps, with seed-to-seed noise. Runs on the lent H200 (target float32 on cuda), every stage through
.gpu/stage.py (compose + run, as benchmarks/bench_learning_curve.py). Resumable: a stage whose
<folder>/<name>.done.json holds the same overrides is skipped (a second call on the same warm machine goes on).

    SWEEP_BUDGET_S=480 SWEEP_WORKERS=6 python3 .gpu/sweep.py

Writes $OUT/sweep.json (every stage's overrides, seconds, result; every row) and $OUT/sweep.md (the table,
means and spreads) after every stage, so a run cut short still brings back what finished.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

T0 = time.monotonic()
BUDGET = float(os.environ.get("SWEEP_BUDGET_S", "480"))
WORKERS = int(os.environ.get("SWEEP_WORKERS", "6"))
ROOT = Path(os.environ.get("SWEEP_ROOT", "/root/sweep"))
OUT = Path(os.environ.get("OUT", "/tmp/out"))
REPO = Path(__file__).resolve().parents[1]
SPEC_SRC = REPO / ".gpu" / "b" / "spec_bench_question.jsonl"
SPEC = ROOT / "spec_bench_question.jsonl"
EVAL_SLOW_S = 40.0  # the brief: a first eval slower than this drops the K sweep from the rest

TARGET = ["target=smollm2", "target.device=cuda", "target.dtype=float32"]
# (lever, N, epochs, extra train overrides, seeds), in priority order of the seeds below
LEVERS = {
    "default": (314, 2, {}),
    "n256_e4": (256, 4, {}),
    "n187_e8": (187, 8, {}),
    "vocab2048": (314, 2, {"method.draft_vocab_size": "2048"}),
    "ttt5": (314, 2, {"method.ttt_steps": "5"}),
}
# priority: the three required levers seed by seed, then the optional rows
HEADS = [("default", 0), ("n256_e4", 0), ("n187_e8", 0),
         ("default", 1), ("n256_e4", 1), ("n187_e8", 1),
         ("default", 2), ("n256_e4", 2), ("n187_e8", 2),
         ("vocab2048", 0), ("vocab2048", 1), ("ttt5", 0)]

lock = threading.Lock()
state: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": BUDGET, "workers": WORKERS,
               "stages": {}, "skipped": [], "notes": [], "sweep_k": True}
timing = {"train_s_per_step": None, "eval_s": None, "first_train": None, "first_eval": None}


def elapsed() -> float:
    return time.monotonic() - T0


def left() -> float:
    return BUDGET - elapsed()


def log(msg: str) -> None:
    print(f"[sweep {elapsed():6.1f}s] {msg}", flush=True)


def overrides_list(d: dict) -> list[str]:
    return [f"{k}={v}" for k, v in d.items()]


def run_stage(folder: Path, name: str, stage: str, overrides: list[str], concurrent: int) -> dict | None:
    """Run (or skip, when done with the same overrides) one stage in a subprocess; its record, or None if it failed."""
    folder.mkdir(parents=True, exist_ok=True)
    stamp = folder / f"{name}.done.json"
    if stamp.is_file():
        rec = json.loads(stamp.read_text())
        if rec.get("overrides") == overrides:
            log(f"skip {folder.name}/{name} (done earlier)")
            with lock:
                state["stages"][f"{folder.name}/{name}"] = rec
            return rec
    ov = folder / f"{name}.overrides.json"
    ov.write_text(json.dumps(overrides))
    res = folder / f"{name}.result.json"
    res.unlink(missing_ok=True)
    logf = folder / f"{name}.log"
    log(f"start {folder.name}/{name} ({concurrent} running)")
    t = time.monotonic()
    env = dict(os.environ, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2")
    with open(logf, "w") as lf:
        rc = subprocess.call([sys.executable, str(REPO / ".gpu" / "stage.py"), stage, str(ov), str(res)],
                             stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    wall = round(time.monotonic() - t, 2)
    if rc != 0 or not res.is_file():
        tail = logf.read_text()[-3000:]
        log(f"FAILED {folder.name}/{name} rc={rc} after {wall} s; log tail:\n{tail}")
        with lock:
            state["stages"][f"{folder.name}/{name}"] = {"overrides": overrides, "failed": rc, "wall_s": wall,
                                                          "log_tail": tail}
        return None
    rec = json.loads(res.read_text())
    rec["wall_s"] = wall
    rec["concurrent_at_start"] = concurrent
    stamp.write_text(json.dumps(rec, default=str))
    with lock:
        state["stages"][f"{folder.name}/{name}"] = rec
    log(f"done {folder.name}/{name}: {wall} s wall, {rec['seconds']} s in-process")
    return rec


running = 0


def guarded(folder: Path, name: str, stage: str, overrides: list[str], estimate: float) -> dict | None:
    """run_stage unless it would not end before the budget (estimate from what was measured)."""
    global running
    stamp = folder / f"{name}.done.json"
    done = stamp.is_file() and json.loads(stamp.read_text()).get("overrides") == overrides
    if not done and estimate > left():
        log(f"SKIP {folder.name}/{name}: estimate {estimate:.0f} s > {left():.0f} s left")
        with lock:
            state["skipped"].append({"stage": f"{folder.name}/{name}", "estimate_s": round(estimate),
                                     "left_s": round(left())})
        return None
    with lock:
        running += 1
        n = running
    try:
        return run_stage(folder, name, stage, overrides, n)
    finally:
        with lock:
            running -= 1
        write_outputs()


def train_overrides(lever: str, seed: int) -> list[str]:
    n, epochs, extra = LEVERS[lever]
    d = {"method": "eagle3", "target": "smollm2", "data": str(ROOT / "data"), "out": str(ROOT / f"{lever}_s{seed}" / "head"),
         "mode": "offline", "deepspeed": "none", "device": "cuda", "lr": "3e-3", "warmup_ratio": "0.05",
         "method.draft_vocab_size": "8192", "max_length": "384", "precision": "fp32", "wandb.mode": "disabled",
         "progress": "false", "save_every": "100000", "train_samples": str(n), "max_steps": str(epochs * n),
         "seed": str(seed), "overwrite": "true"}
    d.update(extra)
    return overrides_list(d)


SETS = {
    "self": lambda: ["prompts.source=holdout", f"prompts.path={ROOT / 'heldout'}", "prompts.holdout=16", "prompts.n=null"],
    "spec_bench": lambda: ["prompts.source=question", f"prompts.path={SPEC}", "prompts.per_category=2", "prompts.n=16"],
}


def eval_overrides(head: Path, set_name: str, out: Path, sweep_k: bool, ngram_first: bool = False) -> list[str]:
    # seed=0 for every eval: the same Spec-Bench sample for every head, whatever its training seed
    return [*TARGET, f"head={head}", *SETS[set_name](), "temperature=0", "drafting.mode=chain",
            "drafting.num_speculative_tokens=3", "max_new_tokens=64", "repeats=1", "warmup_prompts=0",
            "baselines=[ngram]", "plot=false", "progress=false", "seed=0", f"out={out}", "overwrite=true",
            *(["sweep_k=[1,2]"] if sweep_k else []), *(["ngram_first=true"] if ngram_first else [])]


def train_estimate(lever: str) -> float:
    n, epochs, _ = LEVERS[lever]
    per = timing["train_s_per_step"]
    return 60.0 + 0.1 * n * epochs if per is None else 25.0 + 1.5 * per * n * epochs


def eval_estimate() -> float:
    return 120.0 if timing["eval_s"] is None else 1.3 * timing["eval_s"]


def head_job(lever: str, seed: int) -> None:
    folder = ROOT / f"{lever}_s{seed}"
    n, epochs, _ = LEVERS[lever]
    rec = guarded(folder, "train", "train", train_overrides(lever, seed), train_estimate(lever))
    if rec is None:
        return
    with lock:
        if timing["train_s_per_step"] is None:
            timing["train_s_per_step"] = rec["seconds"] / (n * epochs)
    for set_name in ("self", "spec_bench"):
        with lock:
            sk = state["sweep_k"]
        ev = guarded(folder, f"eval_{set_name}", "eval",
                     eval_overrides(folder / "head" / "final", set_name, folder / f"eval_{set_name}", sk),
                     eval_estimate())
        if ev is not None:
            with lock:
                timing["eval_s"] = max(timing["eval_s"] or 0.0, ev["seconds"])


def report(folder: Path) -> dict | None:
    p = folder / "report.json"
    return json.loads(p.read_text()) if p.is_file() else None


def rows() -> list[dict]:
    out = []
    for lever, seed in HEADS:
        folder = ROOT / f"{lever}_s{seed}"
        tr = state["stages"].get(f"{folder.name}/train")
        if not tr or "result" not in tr:
            continue
        n, epochs, extra = LEVERS[lever]
        row = {"lever": lever, "seed": seed, "N": n, "epochs": epochs, "extra": extra,
               "steps": tr["result"].get("steps"), "train_seconds": tr["seconds"], "train_wall_s": tr["wall_s"],
               "train_concurrent_at_start": tr.get("concurrent_at_start"),
               "train_last_metrics": tr["result"].get("metrics")}
        for set_name in ("self", "spec_bench"):
            r = report(folder / f"eval_{set_name}")
            ev = state["stages"].get(f"{folder.name}/eval_{set_name}")
            if r is None or not ev or "result" not in ev:
                continue
            ng = (r.get("baselines") or {}).get("ngram") or {}
            row[set_name] = {"tau": r["tau"], "per_position_acceptance": r["per_position_acceptance"],
                             "ngram_tau": ng.get("tau"), "ngram_per_position_acceptance": ng.get("per_position_acceptance"),
                             "n_prompts": r["n_prompts"], "new_tokens": r.get("new_tokens"),
                             "greedy_identical_fraction": r.get("greedy_identical_fraction"),
                             "speedup": r.get("speedup"), "max_new_tokens": r.get("max_new_tokens"),
                             "k_sweep": [{"k": k["k"], "tau": k["tau"], "per_position_acceptance": k["per_position_acceptance"]}
                                         for k in r.get("k_sweep", [])],
                             "eval_seconds": ev["seconds"], "eval_wall_s": ev["wall_s"]}
        out.append(row)
    return out


def ngram_first_rows() -> list[dict]:
    out = []
    for set_name in ("self", "spec_bench"):
        folder = ROOT / "default_s0"
        r = report(folder / f"eval_ngram_first_{set_name}")
        if r is not None:
            out.append({"head": "default_s0", "set": set_name, "tau": r["tau"],
                        "per_position_acceptance": r["per_position_acceptance"], "n_prompts": r["n_prompts"]})
    return out


def fmt(x, nd=3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def pp(a) -> str:
    return "n/a" if not a else " / ".join(f"{v:.3f}" for v in a)


def table(rs: list[dict]) -> str:
    lines = ["| lever | seed | N | epochs | steps | train s | tau self | per-position self | tau spec_bench "
             "| per-position spec_bench | ngram tau self | ngram tau spec_bench |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        s, b = r.get("self") or {}, r.get("spec_bench") or {}
        lines.append(f"| {r['lever']} | {r['seed']} | {r['N']} | {r['epochs']} | {r['steps']} | {r['train_seconds']:.1f} | "
                     f"{fmt(s.get('tau'))} | {pp(s.get('per_position_acceptance'))} | {fmt(b.get('tau'))} | "
                     f"{pp(b.get('per_position_acceptance'))} | {fmt(s.get('ngram_tau'))} | {fmt(b.get('ngram_tau'))} |")
    lines += ["", "Per lever over seeds: mean [min, max] (n seeds)", "",
              "| lever | tau self | tau spec_bench | train s |", "|---|---|---|---|"]
    for lever in LEVERS:
        mine = [r for r in rs if r["lever"] == lever]
        if not mine:
            continue

        def agg(vals):
            vals = [v for v in vals if v is not None]
            return "n/a" if not vals else f"{statistics.mean(vals):.3f} [{min(vals):.3f}, {max(vals):.3f}] ({len(vals)})"
        lines.append(f"| {lever} | {agg([(r.get('self') or {}).get('tau') for r in mine])} | "
                     f"{agg([(r.get('spec_bench') or {}).get('tau') for r in mine])} | "
                     f"{agg([r['train_seconds'] for r in mine])} |")
    ks = [(r, st) for r in rs for st in ("self", "spec_bench") if (r.get(st) or {}).get("k_sweep")]
    if ks:
        lines += ["", "K sweep (tau at K=1 / 2 / 3)", "", "| lever | seed | set | tau K=1/2/3 |", "|---|---|---|---|"]
        for r, st in ks:
            lines.append(f"| {r['lever']} | {r['seed']} | {st} | "
                         + " / ".join(f"{k['tau']:.3f}" for k in sorted(r[st]["k_sweep"], key=lambda k: k["k"])) + " |")
    nf = ngram_first_rows()
    if nf:
        lines += ["", "ngram_first=true, head default seed 0", "", "| set | tau | per-position |", "|---|---|---|"]
        lines += [f"| {x['set']} | {x['tau']:.3f} | {pp(x['per_position_acceptance'])} |" for x in nf]
    return "\n".join(lines) + "\n"


def write_outputs() -> None:
    with lock:
        rs = rows()
        doc = {**state, "elapsed_s": round(elapsed(), 1), "timing": timing, "rows": rs, "ngram_first": ngram_first_rows()}
        tmp = OUT / "sweep.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        tmp.replace(OUT / "sweep.json")
        (OUT / "sweep.md").write_text(table(rs))


def main() -> int:
    ROOT.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    if not SPEC.is_file():
        shutil.copy(SPEC_SRC, SPEC)
    # 1-2. the training data (330 prompts, hidden states) and the self held-out set (17 prompts of seed 1000,
    # the last 16 held out, 1 new token), at once
    gen = [*TARGET, "prompts=self", "prompts.n=330", "prompts.seed=0", "prompts.max_prompt_tokens=64", "seed=0",
           "max_new_tokens=128", "hidden_states=true", "backend.batch_size=64", f"out={ROOT / 'data'}", "overwrite=true"]
    held = [*TARGET, "prompts=self", "prompts.n=17", "prompts.seed=1000", "prompts.max_prompt_tokens=64",
            "max_new_tokens=1", f"out={ROOT / 'heldout'}", "overwrite=true"]
    with ThreadPoolExecutor(2) as ex:
        f1 = ex.submit(guarded, ROOT / "stamps", "data_gen", "data_gen", gen, 0)
        f2 = ex.submit(guarded, ROOT / "stamps", "heldout", "data_gen", held, 0)
        ok = f1.result() is not None and f2.result() is not None
    if not ok:
        log("data-gen failed: stopping")
        write_outputs()
        return 2
    # 3-4. the first head alone (its training and first eval timed without other work on the GPU)
    folder = ROOT / "default_s0"
    rec = guarded(folder, "train", "train", train_overrides("default", 0), train_estimate("default"))
    if rec is None:
        log("first training failed: stopping")
        write_outputs()
        return 3
    timing["first_train"] = {"seconds": rec["seconds"], "wall_s": rec["wall_s"], "steps": 628}
    timing["train_s_per_step"] = rec["seconds"] / 628
    ev = guarded(folder, "eval_self", "eval", eval_overrides(folder / "head" / "final", "self", folder / "eval_self", True),
                 eval_estimate())
    if ev is not None:
        timing["eval_s"] = ev["seconds"]
        timing["first_eval"] = {"seconds": ev["seconds"], "wall_s": ev["wall_s"], "sweep_k": [1, 2]}
        if ev["seconds"] > EVAL_SLOW_S:
            state["sweep_k"] = False
            state["notes"].append(f"first eval took {ev['seconds']:.0f} s (> {EVAL_SLOW_S:.0f} s): no sweep_k in the rest")
    # the rest, WORKERS at a time, in priority order (the first head's spec_bench eval first)
    with ThreadPoolExecutor(WORKERS) as ex:
        futs = [ex.submit(head_job, lever, seed) for lever, seed in HEADS]
        ng = []
        for set_name in ("self", "spec_bench"):
            ng.append(ex.submit(lambda s=set_name: guarded(
                folder, f"eval_ngram_first_{s}", "eval",
                eval_overrides(folder / "head" / "final", s, folder / f"eval_ngram_first_{s}", False, ngram_first=True),
                eval_estimate())))
        for f in futs + ng:
            f.result()
    write_outputs()
    log(f"all done in {elapsed():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
