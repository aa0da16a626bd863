"""data-gen's backend=vllm inside vLLM's own venv: `python vllm_generate.py job.json result.json`.

Run by path with the engine's python (draftsmith.core.engine.run_job(job, worker=<this file>)); it imports only the
standard library, vLLM and its sibling vllm_worker.py (the same rule), never draftsmith. One `LLM` on the job's
target folder in the job's dtype with `max_num_seqs` sequences at most; every prompt (token ids, rendered and
tokenized by draftsmith) is added to its engine at once and the engine is stepped until all are finished, so vLLM
batches them continuously. Greedy when the job says so; else each request samples with its own `seed` (vLLM's
sampler). As each request finishes, its index is appended to the job's `progress` file, one a line.

    job    {"target": folder, "dtype": "float32", "max_model_len": int, "max_num_seqs": int,
            "prompts": [[ids]], "seeds": [int], "greedy": bool, "temperature": float, "top_p": float,
            "top_k": int, "max_tokens": int, "stop_token_ids": [ids], "progress": path | null}
    result {"vllm_version": str, "torch_version": str, "runs": {"generate": run}}
    run    {"ok": true, "tokens": [[ids]] (each prompt's answer, its stop token included), "seconds": float
            (adding the requests to the last finished), "load_s": float, "warnings": [str]}
           or {"ok": false, "error": str (vLLM's exception, one line), "traceback": str, "warnings": [str]}
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from vllm_worker import LogLines, marker, one_line, shutdown, start

RUN = "generate"
KV_CACHE_MAX_BYTES = 4 << 30  # on CPU: at most this much KV cache (vLLM waits or preempts when it is full)


def kv_cache_bytes(job: dict) -> int | None:
    """On CPU, room for max_num_seqs sequences of max_model_len tokens (vLLM's CPU default takes a share of the
    machine's memory); None elsewhere or for a folder without a readable config.json (vLLM's own default)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    try:
        with open(os.path.join(job["target"], "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    c = config.get("text_config", config)
    heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * heads * head_dim * (4 if job["dtype"] == "float32" else 2)  # K and V
    need = per_token * int(job["max_num_seqs"]) * int(job["max_model_len"]) * 5 // 4 + (16 << 20)  # blocks' slack
    return min(need, KV_CACHE_MAX_BYTES)


def build_llm(job: dict):
    """The job's LLM: its target folder and dtype, max_num_seqs sequences at once, eager on CPU."""
    from vllm import LLM
    from vllm.platforms import current_platform

    kwargs = dict(model=job["target"], dtype=job.get("dtype", "float32"), seed=0,
                  max_model_len=int(job["max_model_len"]), max_num_seqs=int(job["max_num_seqs"]),
                  enforce_eager=current_platform.is_cpu(), disable_log_stats=True)
    room = kv_cache_bytes(job)
    if room:
        kwargs["kv_cache_memory_bytes"] = room
    return LLM(**kwargs)


def sampling(job: dict, seed: int):
    """One request's sampling: greedy, or temperature / top-p / top-k with the request's own seed; only the
    finished output comes back (as `LLM.generate` asks)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    common = dict(max_tokens=int(job["max_tokens"]), stop_token_ids=list(job.get("stop_token_ids") or []),
                  detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
    if job["greedy"]:
        return SamplingParams(temperature=0.0, **common)
    extra = {"top_k": int(job["top_k"])} if job.get("top_k") else {}
    return SamplingParams(temperature=float(job["temperature"]), top_p=float(job["top_p"]), seed=int(seed),
                          **extra, **common)


def engine_input(llm, ids: list[int]):
    """A prompt of token ids as the engine takes it: rendered by the LLM's renderer where it has one (vLLM
    deprecates raw prompts in `LLMEngine.add_request`), else the raw `TokensPrompt`."""
    from vllm import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(ids))
    render = getattr(getattr(llm, "renderer", None), "render_cmpl", None)
    return render([prompt])[0] if render else prompt


def generate(llm, job: dict) -> list[list[int]]:
    """Every prompt's answer tokens: all requests added to the engine, then steps until none is left."""
    engine = llm.llm_engine
    prompts, seeds = job["prompts"], job["seeds"]
    for j, (ids, seed) in enumerate(zip(prompts, seeds)):
        engine.add_request(str(j), engine_input(llm, ids), sampling(job, seed))
    tokens: list = [None] * len(prompts)
    progress = open(job["progress"], "a") if job.get("progress") else None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    j = int(out.request_id)  # the id given to add_request (vLLM keeps its own beside it)
                    tokens[j] = list(out.outputs[0].token_ids)
                    if progress:
                        progress.write(f"{j}\n")
                        progress.flush()
    finally:
        if progress:
            progress.close()
    missing = [j for j, t in enumerate(tokens) if t is None]
    if missing:
        raise RuntimeError(f"vLLM finished without an answer to {len(missing)} prompts (the first: {missing[0]})")
    return tokens


def run(job: dict, log: LogLines) -> dict:
    t0 = time.perf_counter()
    try:
        llm = build_llm(job)
    except Exception as e:  # vLLM refused the folder or the settings: record what it said
        return {"ok": False, "error": one_line(e), "traceback": traceback.format_exc()[-4000:], "warnings": log.lines}
    try:
        load_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        tokens = generate(llm, job)
        return {"ok": True, "tokens": tokens, "seconds": time.perf_counter() - t1, "load_s": load_s,
                "warnings": log.lines}
    except Exception as e:
        return {"ok": False, "error": one_line(e), "traceback": traceback.format_exc()[-4000:], "warnings": log.lines}
    finally:
        shutdown(llm)


def main(argv: list[str]) -> int:
    job, log, versions = start(argv[1])
    result_path = argv[2]
    marker(RUN, "begin")  # draftsmith.core.engine attaches the lines of vLLM's processes in between to the run
    try:
        outcome = run(job, log)
    finally:
        marker(RUN, "end")
    with open(result_path, "w") as f:
        json.dump({**versions, "runs": {RUN: outcome}}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
