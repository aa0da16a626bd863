"""Benchmark: two draftsmith processes sharing the cores, against one alone (not a test).

    python benchmarks/bench_sharing.py --out runs/bench_sharing.json [--prompts-n 4] [--max-new-tokens 48]

Runs `draftsmith data-gen` on the embedded SmolLM2 (Spec-Bench first turns, greedy, fp32, no hidden
states) as a subprocess: once alone, then two at once on the same cores, under two OpenMP settings:
  before   GOMP_SPINCOUNT=300000: libgomp's own default when no wait policy is set (idle threads spin
           for ~300k iterations before sleeping), i.e. what draftsmith ran with before it set anything;
  passive  OMP_WAIT_POLICY=PASSIVE: an idle thread sleeps at once (fair sharing, but slow small ops alone);
  after    no OpenMP variable set: what `draftsmith` sets itself (draftsmith.core.procenv.share_cores:
           GOMP_SPINCOUNT=10000, a short spin, then sleep).
The figure is the wall time of each data-gen process (model load included) and the slowdown of two at
once against one alone (2.0 = the cores are shared fairly, more = spinning threads waste them). A run
that does not finish within --timeout-s is reported as such. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftsmith.core.artifacts import atomic_write_json
from draftsmith.core.machine import machine_info

SPEC_BENCH = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_question.jsonl")
SETTINGS = {"before": {"GOMP_SPINCOUNT": "300000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "after": {}}
OPENMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")


def data_gen_command(out: Path, args) -> list[str]:
    return [sys.executable, "-m", "draftsmith.cli", "data-gen", "target=smollm2", "target.dtype=float32",
            "prompts=question", f"prompts.path={args.prompts}", f"prompts.n={args.prompts_n}",
            f"max_new_tokens={args.max_new_tokens}", f"backend.batch_size={args.batch_size}",
            "hidden_states=false", f"out={out}"]


def run_together(n: int, env_extra: dict, args, root: Path) -> list[float | None]:
    """Start `n` data-gens at once; each one's wall seconds (None: still running at --timeout-s, killed)."""
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS}
    env.update(env_extra)
    procs = []
    for i in range(n):
        out = Path(tempfile.mkdtemp(prefix=f"dg{i}.", dir=root))
        procs.append((time.perf_counter(), subprocess.Popen(data_gen_command(out / "out", args), env=env,
                                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    seconds: list[float | None] = [None] * n
    deadline = time.perf_counter() + args.timeout_s
    while any(s is None for s in seconds) and time.perf_counter() < deadline:
        for i, (t0, p) in enumerate(procs):
            if seconds[i] is None and p.poll() is not None:
                if p.returncode != 0:
                    raise SystemExit(f"data-gen failed ({p.returncode}): {p.stderr.read().decode()[-2000:]}")
                seconds[i] = round(time.perf_counter() - t0, 1)
        time.sleep(0.2)
    for _, p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_sharing.json")
    ap.add_argument("--prompts", default=SPEC_BENCH)
    ap.add_argument("--prompts-n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per configuration")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = ap.parse_args(argv)
    result = {"machine": machine_info(), "prompts_n": args.prompts_n, "max_new_tokens": args.max_new_tokens,
              "batch_size": args.batch_size, "settings": {k: v or "draftsmith's own (GOMP_SPINCOUNT=10000)"
                                                          for k, v in SETTINGS.items()}, "rows": {}}
    with tempfile.TemporaryDirectory(prefix="bench_sharing.") as root:
        run_together(1, {}, args, Path(root))  # warm-up: the GGUF -> safetensors cache, page cache
        for name in args.settings:
            env = SETTINGS[name]
            alone = run_together(1, env, args, Path(root))[0]
            pair = run_together(2, env, args, Path(root))
            slowest = None if None in pair else max(pair)
            row = {"alone_s": alone, "two_at_once_s": pair,
                   "slowdown": round(slowest / alone, 2) if slowest and alone else None}
            result["rows"][name] = row
            print(f"{name:7} alone {alone} s; two at once {pair} s; slowdown {row['slowdown']}x "
                  f"(2.0 = fair sharing)", flush=True)
    cpu = result["machine"]
    print(f"machine: {cpu['cpu']} ({cpu['cpu_vector']}), {cpu['allowed_cores']} cores, torch {cpu['torch']}")
    atomic_write_json(args.out, result)
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
