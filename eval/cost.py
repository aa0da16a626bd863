"""The cost model of speculative decoding, measured, and what to set in a serving engine.

    speedup(K) = tau(K) * t_step / (t_verify(K+1) + t_draft(K))

t_step       one target decode step (1 token) over the eval's typical cache length;
t_verify(n)  one target pass over n tokens (the root + n-1 draft tokens), same cache length;
t_draft(K)   the drafter's seconds per verification at draft length K (propose + update);
tau(K)       tokens emitted per verification = 1 + sum_{i<K} a_i, a_i = per-position acceptance
             (drafts accepted at position i / drafts proposed there, unconditional: a chain's i-th
             token counts only if all before it were accepted, so the sum is the expected accepted length).

t_step and t_verify are timed here (`measure_target`, sizes interleaved, median); t_draft and a_i
come from the decode itself. The measured speedup of the same runs sits beside the prediction, so
a model that is off shows up in the report. `serving_settings` turns the best K into the flags of
vLLM (--speculative-config JSON: method, model, num_speculative_tokens) and SGLang
(--speculative-algorithm, --speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Callable, Mapping, Optional, Sequence

import torch

from ..core.engine import Engines
from .config import EvalConfig
from .decoder import DraftingConfig, tree_mask


# ---- the model ------------------------------------------------------------------------------

def predicted_tau(acceptance: Sequence[float], num_speculative_tokens: int) -> float:
    """Expected tokens per verification of a chain of K drafts: 1 (the bonus) + sum of the first K a_i."""
    return 1.0 + sum(acceptance[:num_speculative_tokens])


def predicted_speedup(tau: float, t_step: float, t_verify: float, t_draft: float) -> float:
    """tau * t_step / (t_verify + t_draft): target-only seconds for tau tokens over one speculative cycle."""
    cycle = t_verify + t_draft
    return tau * t_step / cycle if cycle > 0 else 0.0


def break_even_tau(t_step: float, t_verify: float, t_draft: float) -> float:
    """The tau at which speculative decoding is exactly as fast as target-only decoding."""
    return (t_verify + t_draft) / t_step if t_step > 0 else float("inf")


# ---- timing the target ----------------------------------------------------------------------

def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure_target(runner, context: int, sizes: Sequence[int], repeats: int = EvalConfig.cost_repeats,
                   tree_sizes: Sequence[int] = (),
                   clock: Callable[[], float] = time.perf_counter) -> dict:
    """Median seconds of one target pass over n tokens after a `context`-token cache, for n in `sizes`
    (chains: causal mask) and `tree_sizes` (a root with n-1 children: the tree-mask path).

    Sizes are interleaved within each repeat so machine-speed drift hits all alike; one warm-up round."""
    context = max(1, min(int(context), runner.max_len - max([*sizes, *tree_sizes, 1]) - 1))
    dev = runner.device
    prompt = torch.randint(0, runner.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).to(dev)
    runner.reset()
    runner.forward(prompt, torch.arange(context, device=dev), 0, logits_rows="last")
    runner.commit(context)
    shapes = [("chain", n) for n in sizes] + [("tree", n) for n in tree_sizes]
    times: dict = {s: [] for s in shapes}
    for rep in range(repeats + 1):
        for kind, n in shapes:
            tokens = torch.full((n,), 7, device=dev)
            if kind == "chain":
                positions, mask = context + torch.arange(n, device=dev), None
            else:  # a root and n-1 siblings: every node at depth 1
                parents = [-1] * (n - 1)
                positions = context + torch.tensor([0] + [1] * (n - 1), device=dev)
                mask = tree_mask(parents, context, dev)
            _sync(dev)
            t0 = clock()
            runner.forward(tokens, positions, context, attn_mask=mask)
            _sync(dev)
            if rep:  # round 0 is the warm-up
                times[(kind, n)].append(clock() - t0)
    runner.reset()
    med = {s: statistics.median(v) for s, v in times.items()}
    return {"context": context, "repeats": repeats,
            "step_s": med[("chain", 1)] if ("chain", 1) in med else None,
            "verify_s": {str(n): med[("chain", n)] for n in sizes},
            "tree_verify_s": {str(n): med[("tree", n)] for n in tree_sizes}}


# ---- the table ------------------------------------------------------------------------------

def decode_clock(target_only: Sequence, runs: Mapping[int, Sequence]) -> dict:
    """The decode's own clock (eval's Samples: prefill, decode and verify seconds, medians over repeats): one
    target-only step, and per decoded K the seconds of one verification inside the decode, the prefill and the
    decode-only speedup. The isolated passes `measure_target` times can run at another speed than the same pass
    inside the decode (on the 2-core Zen 4 one 1-token pass timed 63.5 ms while the decode ran 45 ms a token):
    the cost model reads time from here and keeps the timed passes for the shape of t_verify over K."""
    steps = sum(s.verifications for s in target_only)
    emitted = sum(s.emitted_tokens for s in target_only)
    base_decode = sum(s.decode_seconds for s in target_only)
    out = {"step_s": base_decode / steps if steps else None,
           "prefill_s": sum(s.prefill_seconds for s in target_only) / max(len(target_only), 1),
           "decode_tokens": emitted / max(len(target_only), 1), "by_k": {}}
    for num_speculative_tokens, samples in runs.items():
        n_ver = sum(s.verifications for s in samples)
        spec_emitted, spec_decode = sum(s.emitted_tokens for s in samples), sum(s.decode_seconds for s in samples)
        out["by_k"][int(num_speculative_tokens)] = {
            "verify_s": sum(s.verify_seconds for s in samples) / n_ver if n_ver else None,
            "prefill_s": sum(s.prefill_seconds for s in samples) / max(len(samples), 1),
            "decode_speedup": (base_decode / emitted) / (spec_decode / spec_emitted)
            if emitted and spec_emitted and spec_decode and base_decode else None}
    return out


def cost_table(target: dict, acceptance: Sequence[float], runs: Sequence[dict], mode: str = DraftingConfig.mode,
               max_num_speculative_tokens: Optional[int] = None, one_forward: bool = False,
               clock: Optional[dict] = None) -> list[dict]:
    """One row per K: predicted tau and speedup, and (where K was decoded) the measured ones.

    target: `measure_target`'s dict. acceptance: the head's per-position acceptance (from its longest-K
    run). runs: one dict per decoded K: {k, tau, speedup, draft_s_per_verification, mean_draft_size}.
    K without a run of its own borrow t_draft from the nearest decoded K: scaled by K / that K for a drafter
    that drafts token by token, as it is for a drafter that drafts its chain in one forward whatever K
    (`one_forward`: P-EAGLE, the block drafters DFlash and DSpark).

    clock (`decode_clock`): time read from the decode itself. t_step is then the target-only decode's own step;
    t_verify at a decoded K its verifications' own seconds, and at another K the timed pass scaled by the
    decode/timed ratio of the nearest decoded K; and the prediction is end to end like the measured speedup
    (each side's prefill added: (P_target + N t_step) / (P_spec + N / tau (t_verify + t_draft)), N the
    target-only decode's tokens per answer). `predicted_speedup_timed_passes` keeps the formula on the timed
    passes alone, and `measured_decode_speedup` the decode-only measurement, beside it."""
    by_k = {int(r["k"]): r for r in runs}
    timed_step = target["step_s"]
    t_step = clock["step_s"] if clock and clock.get("step_s") else timed_step
    top = max_num_speculative_tokens or max([*by_k, len(acceptance)] or [1])
    rows = []
    for num_speculative_tokens in range(1, top + 1):
        run = by_k.get(num_speculative_tokens)
        if run is not None:
            t_draft = run["draft_s_per_verification"]
        elif by_k:
            near = min(by_k, key=lambda j: (abs(j - num_speculative_tokens), j))
            t_draft = by_k[near]["draft_s_per_verification"] * (1 if one_forward else num_speculative_tokens / near)
        else:
            t_draft = 0.0
        if mode == "tree" and run is not None:
            n = int(round(run["mean_draft_size"])) + 1
            timed_verify = target["tree_verify_s"].get(str(n))
            tau = run["tau"]  # a tree's tau is not a chain's sum: the measured one
        else:
            n = num_speculative_tokens + 1
            timed_verify = target["verify_s"].get(str(n))
            tau = (predicted_tau(acceptance, num_speculative_tokens) if num_speculative_tokens <= len(acceptance)
                   else None)
        if timed_verify is None or tau is None:
            continue
        row: dict[str, Optional[float]] = {"k": num_speculative_tokens, "verify_tokens": n}
        t_verify, predicted = timed_verify, predicted_speedup(tau, t_step, timed_verify, t_draft)
        if clock and clock.get("step_s") and clock["by_k"]:
            near = min(clock["by_k"], key=lambda j: (abs(j - num_speculative_tokens), j))
            at = clock["by_k"][near]
            timed_near = (target["tree_verify_s"].get(str(int(round(by_k[near]["mean_draft_size"])) + 1))
                          if mode == "tree" else target["verify_s"].get(str(near + 1)))
            if at["verify_s"] and timed_near:
                t_verify = (at["verify_s"] if near == num_speculative_tokens
                            else timed_verify * at["verify_s"] / timed_near)
            tokens = clock["decode_tokens"]
            spec_prefill = clock["by_k"].get(num_speculative_tokens, at)["prefill_s"]
            cycle = t_verify + t_draft
            predicted = ((clock["prefill_s"] + tokens * t_step) / (spec_prefill + tokens / tau * cycle)
                         if cycle > 0 and tau > 0 else 0.0)
            row.update(timed_step_s=timed_step,
                       predicted_speedup_timed_passes=predicted_speedup(tau, timed_step, timed_verify, t_draft),
                       measured_decode_speedup=clock["by_k"].get(num_speculative_tokens, {}).get("decode_speedup"))
        row.update({"t_step_s": t_step, "t_verify_s": t_verify, "t_draft_s": t_draft,
                    "verify_over_step": t_verify / t_step if t_step else None,
                    "predicted_tau": tau, "break_even_tau": break_even_tau(t_step, t_verify, t_draft),
                    "predicted_speedup": predicted,
                    "measured_tau": run["tau"] if run else None,
                    "measured_speedup": run["speedup"] if run else None})
        rows.append(row)
    return rows


def best_measured(rows: Sequence[dict]) -> Optional[dict]:
    """The row with the highest measured speedup (ties: the smaller K), or None when nothing was measured."""
    measured = [r for r in rows if r.get("measured_speedup") is not None]
    return max(measured, key=lambda r: (r["measured_speedup"], -r["k"])) if measured else None


# ---- what to set ----------------------------------------------------------------------------

def serving_settings(method: str, engines: Engines, target_model: str, head_path: Optional[str],
                     num_speculative_tokens: int, mode: str = DraftingConfig.mode,
                     tree_top_k: int = DraftingConfig.tree_top_k, tree_size: Optional[int] = None,
                     ngram_min: int = EvalConfig.ngram_min, ngram_max: int = EvalConfig.ngram_max,
                     line_break: bool = False, stop_below: float = DraftingConfig.stop_below) -> dict:
    """vLLM's --speculative-config and SGLang's --speculative-* flags for `method` drafting
    `num_speculative_tokens` tokens (K).

    `engines`: the method's row's names for it (draftsmith.core.methods; ngram's is eval's NGRAM_ENGINES; ngram+<m>
    is served as <m>). The one place that turns them into the engines' flags: eval's report and publish's model
    card both call it (`line_break=True`: one flag per line, for the card). Tree drafting (tree_size = the tree
    budget) maps to SGLang's topk / num-draft-tokens (the root counted, as SGLang does); vLLM gets the chain of
    the same depth. An engine that cannot serve the method gets None and a reason."""
    out: dict = {"k": num_speculative_tokens, "mode": mode}
    model = head_path or "<head folder>"
    sep = " \\\n    " if line_break else " "
    served = model if engines.in_target else target_model  # MTP: the stitched target folder is the model
    if engines.vllm is None:
        out["vllm"] = {"config": None, "command": None, "note": f"vLLM has no speculative method for {method!r}."}
    else:
        spec: dict = {"method": engines.vllm}
        if engines.in_target:
            spec.update(num_speculative_tokens=num_speculative_tokens)
        elif engines.draft_folder:
            spec.update(model=model, num_speculative_tokens=num_speculative_tokens)
        else:  # prompt lookup: no draft folder, the n-gram sizes instead
            spec.update(num_speculative_tokens=num_speculative_tokens, prompt_lookup_min=ngram_min,
                        prompt_lookup_max=ngram_max)
        spec.update(engines.vllm_options)
        text = json.dumps(spec)
        out["vllm"] = {"config": spec, "command": f"vllm serve {served}{sep}--speculative-config '{text}'"}
    if engines.sglang is None:
        out["sglang"] = {"flags": None, "command": None,
                         "note": f"SGLang has no speculative algorithm for {method!r}; serve it with vLLM."}
    else:
        tree = mode == "tree"
        topk = tree_top_k if tree else 1
        draft_tokens = (tree_size if tree and tree_size else num_speculative_tokens) + 1  # SGLang counts the root token
        flags: dict[str, str | int] = {"--speculative-algorithm": engines.sglang}
        if engines.draft_folder:
            flags["--speculative-draft-model-path"] = model
        flags.update({"--speculative-num-steps": num_speculative_tokens, "--speculative-eagle-topk": topk,
                      "--speculative-num-draft-tokens": draft_tokens})
        text = sep.join(f"{f} {v}" for f, v in flags.items())
        out["sglang"] = {"flags": flags,
                         "command": f"python -m sglang.launch_server --model-path {served}{sep}{text}"}
    # ngram+<m> (eval's ngram_first): llama.cpp mixes the two, vLLM and SGLang serve <m> alone
    out["llamacpp"] = llamacpp_settings(method.removeprefix("ngram+"), engines, num_speculative_tokens, ngram_max, sep,
                                        ngram_first=method.startswith("ngram+"), stop_below=stop_below)
    return out


def llamacpp_settings(method: str, engines: Engines, num_speculative_tokens: int,
                      ngram_max: int = EvalConfig.ngram_max, sep: str = " ", ngram_first: bool = False,
                      stop_below: float = DraftingConfig.stop_below) -> dict:
    """llama-server's --spec-type and command for `method` at K (the target and drafter as GGUF files: export
    format=gguf writes the drafter). `ngram_first`: llama.cpp's mixing, n-gram lookup first, then the drafter.
    `stop_below` (eval's drafting.stop_below) is llama.cpp's --spec-draft-p-min, the same rule: the drafter's chain
    stops before its first depth whose top probability is below it (llama.cpp reads that probability among the
    drafter's 10 best, renormalized, so it cuts a little later than the built-in decoder for the same value)."""
    if engines.llamacpp is None:
        return {"spec_type": None, "command": None,
                "note": f"llama.cpp has no loader for {method!r} drafters; serve it with vLLM."}
    types = (["ngram-simple"] if ngram_first and engines.draft_folder else []) + [engines.llamacpp]
    flags = ["--spec-type", ",".join(types), "--spec-draft-n-max", str(num_speculative_tokens)]
    if "ngram-simple" in types:  # llama.cpp's defaults match 12 tokens and copy 48: ours match ngram_max, copy K
        flags += ["--spec-ngram-simple-size-n", str(ngram_max),
                  "--spec-ngram-simple-size-m", str(num_speculative_tokens)]
    if stop_below and engines.draft_folder:  # llama.cpp's default p-min is 0: a fixed K
        flags += ["--spec-draft-p-min", f"{stop_below:g}"]
    draft = ["-md", "<head>.gguf"] if engines.draft_folder else []
    parts = ["llama-server -m <target>.gguf", " ".join(draft + flags[:2]), " ".join(flags[2:]), "--parallel 1"]
    return {"spec_type": ",".join(types), "flags": flags,
            "command": sep.join(p for p in parts if p)}
