"""Benchmark: where the seconds of one vLLM `LLM` start go on this CPU, and what each lever saves (not a test).

    python benchmarks/bench_vllm_start.py [--llms 3] [--out runs/bench_vllm_start.json]

Each configuration is one engine job (draftsmith.core.engine.run_job, the worker the engine tests use) that builds
`--llms` target-only LLMs of the embedded SmolLM2 (fp32) one after the other and decodes one prompt of 16 tokens
with each. Per configuration it prints the job's wall time, each LLM's start (`load_s`: LLM() returned) and the
phases vLLM logs (weights loaded, model loaded, engine initialised: KV cache and warm-up), so the remainder of a
start is the engine-core process and its imports. Levers:

    multiprocess   vLLM's default: one engine-core process spawned per LLM (what `eval engine=vllm` uses)
    in_process     VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core in the worker's own process
    kv_64MiB       in_process with a 64 MiB KV cache instead of 512 MiB
    max_len_4096   in_process with max_model_len 4096 instead of the job's (prompt + tokens + 64)

enforce_eager=True (no torch.compile, so no warm-up forward) is on in every configuration: the worker always sets it.
Run it alone: two processes on these cores make torch's threads spin and every figure collapses.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

from draftsmith.core import engine
from draftsmith.core.artifacts import atomic_write_json
from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.eval import engine_vllm as ev_engine
from draftsmith.core.machine import machine_info

# vLLM's own log lines for the phases of a start (vllm 0.32.0), each with its seconds
PHASES = {
    "weights_s": re.compile(r"Loading weights took ([0-9.]+) seconds"),
    "model_load_s": re.compile(r"Model loading took [0-9.]+ GiB(?: memory)? and ([0-9.]+) seconds"),
    "engine_init_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) seconds"),
}
CONFIGS = {
    "multiprocess": {},
    "in_process": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    "kv_64MiB": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "kv_cache_bytes": 64 << 20},
    "max_len_4096": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "max_model_len": 4096},
}


def phases(log: str) -> dict[str, list[float]]:
    return {name: [float(m) for m in rx.findall(log)] for name, rx in PHASES.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llms", type=int, default=3, help="LLMs built one after the other in each job")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--out", default="runs/bench_vllm_start.json")
    args = p.parse_args()
    missing = engine.engine_missing()
    if missing:
        raise SystemExit(missing)
    target = load_target(TargetConfig(name="smollm2", dtype="float32"))
    prompt = target.tokenizer("Name three prime numbers.")["input_ids"]
    runs = [{"name": f"target_only_{i}", "speculative_config": None} for i in range(args.llms)]
    rows = {}
    for name in args.configs:
        job = ev_engine.engine_job(ev_engine.served_target(target), [prompt], 16, target.eos_token_ids, runs,
                                   warmup=0)
        env = {k: v for k, v in CONFIGS[name].items() if k.isupper()}  # vLLM's own switches, read from the environment
        job.update({k: v for k, v in CONFIGS[name].items() if not k.isupper()})
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "engine.log"
            t0 = time.perf_counter()
            result = engine.run_job(job, timeout_s=1800, log_path=log, env=env)
            wall = time.perf_counter() - t0
            found = phases(log.read_text(errors="replace"))
        loads = [r["load_s"] for r in result["runs"].values() if r.get("ok")]
        failed = {n: r["error"] for n, r in result["runs"].items() if not r.get("ok")}
        tokens = {tuple(map(tuple, r["tokens"])) for r in result["runs"].values() if r.get("ok")}
        rows[name] = {"job_wall_s": wall, "load_s": loads, "median_load_s": statistics.median(loads) if loads else None,
                      **found, "failed": failed, "outputs_identical": len(tokens) == 1, **CONFIGS[name]}
        print(f"{name:14s} job {wall:6.1f} s  LLM() {' '.join(f'{s:5.1f}' for s in loads)} s  "
              + "  ".join(f"{k} {' '.join(f'{v:.1f}' for v in vals)}" for k, vals in found.items())
              + (f"  FAILED {failed}" if failed else ""), flush=True)
    out = {"machine": machine_info("cpu"), "llms_per_job": args.llms, "configs": rows,
           "vllm_version": result.get("vllm_version")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(args.out), out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
