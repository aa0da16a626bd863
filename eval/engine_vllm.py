"""`draftsmith eval engine=vllm`: the same prompts decoded inside vLLM, its figures beside the built-in decoder's.

vLLM runs in its own venv (draftsmith.core.engine runs `vllm_worker.py` there); this module builds the job from an
eval run's prompts and settings, and turns the engine's result into the report's `engine` section:

    engine_runs      target-only, the head at K (and every sweep_k), the ngram baseline: one vLLM `LLM` each
    engine_job       the target's HF folder, the prompts as the token ids the built-in decoder answered, greedy
    agreement        the built-in decoder's acceptance in vLLM's counting beside vLLM's counters
    engine_report    run the job, then per run: greedy output, τ and per-position acceptance, tokens/s, speedup

vLLM's counting (vllm/v1/spec_decode/metrics.py), used on both sides of every comparison: a verification that
had a draft is one `num_drafts`; τ = 1 + num_accepted_tokens / num_drafts (bonus token included);
per-position acceptance[i] = num_accepted_tokens_per_pos[i] / num_drafts. A verification without a draft
(n-gram with no match) is not counted, where draftsmith's own τ counts it; for EAGLE-3, P-EAGLE and draft
models every verification has a draft, and the two τ are the same figure. The built-in decoder shortens the
draft that would run past max_new_tokens, vLLM drafts K and drops what is past it: the last verification of
a prompt may count differently, every earlier one must agree exactly (`steps_identical_fraction`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..core import DraftsmithError, engine
from ..core.engine import Engines
from ..heads import mtp_folders
from . import metrics
from .config import EvalConfig, check_engine_options
from .cost import predicted_tau, serving_settings
from .proposers.ngram import NGRAM_ENGINES

log = logging.getLogger(__name__)

TARGET_ONLY = "target_only"
# |vLLM − built-in| allowed on τ and on each per-position acceptance (`agreement`: over every verification but each
# prompt's last where vLLM gave per-request detail, else pooled over all, where only the last may differ).
TOLERANCE = 0.02
# vLLM's log line when a folder carries mask_hidden but the speculative config has no parallel_drafting
SEQUENTIAL_FALLBACK = "not configured for parallel drafting"
KV_CACHE_BYTES = 512 << 20  # vLLM's KV cache for one sequence at a time (its default takes GiBs)


# --------------------------------------------------------------------------- the job

def served_target(target) -> str:
    """What vLLM loads as the target (the HF folder draftsmith loaded, a GGUF's cached safetensors copy, or its id)."""
    return engine.served_folder(target, "engine=vllm")


def speculative_config(method: str, engines: Engines, head: Optional[str], num_speculative_tokens: int,
                       ngram_min: int = EvalConfig.ngram_min, ngram_max: int = EvalConfig.ngram_max) -> dict:
    """vLLM's speculative_config for `method` (its row's `engines`) at K: the one eval recommends and publish's
    card prints."""
    spec = serving_settings(method, engines, "<target>", head, num_speculative_tokens, ngram_min=ngram_min,
                            ngram_max=ngram_max)["vllm"]["config"]
    if spec is None:
        raise DraftsmithError(f"engine=vllm: vLLM has no speculative method for {method!r}.")
    return spec


def engine_runs(cfg, drafter, num_speculative_tokens: int) -> list[dict]:
    """The job's runs for an eval: target-only, the head at K and at each sweep_k, and the ngram baseline."""
    runs: list[dict[str, Any]] = [{"name": TARGET_ONLY, "speculative_config": None}]
    if drafter.make is None:
        return runs
    head = drafter.info.get("path")
    for swept in dict.fromkeys([num_speculative_tokens, *cfg.sweep_k]):
        runs.append({"name": run_name(drafter.method, swept, num_speculative_tokens), "k": swept,
                     "speculative_config": speculative_config(drafter.method, drafter.engines, head, swept,
                                                              cfg.ngram_min, cfg.ngram_max)})
    if "ngram" in cfg.baselines and drafter.method != "ngram":
        runs.append({"name": "ngram", "k": num_speculative_tokens,
                     "speculative_config": speculative_config("ngram", NGRAM_ENGINES, None, num_speculative_tokens,
                                                              cfg.ngram_min, cfg.ngram_max)})
    return runs


def run_name(method: str, num_speculative_tokens: int, main_num_speculative_tokens: int) -> str:
    """A run's name in the report: the method at the eval's K, `<method>@K=<n>` at another K of the sweep."""
    return method if num_speculative_tokens == main_num_speculative_tokens else f"{method}@K={num_speculative_tokens}"


def in_target_model(drafter, target_folder: str, out: Path, dtype: torch.dtype) -> str:
    """The folder vLLM loads as the model for a drafter served inside its target (an MTP layer: `{"method": "mtp"}`,
    no draft path). A head that is a whole MiMo folder (head=mtp, an `export format=mimo` folder) is served as it is;
    train's output (the MTP layers alone) is first stitched into a copy of the served target, as `export
    format=mimo` writes it, at `out/engine_model` (in the job's dtype): served otherwise, vLLM would run the layer the
    target folder ships (or none), not the head the built-in decoder measured."""
    head = Path(drafter.info["path"])
    if not stitched_to_serve(drafter):
        return str(head)
    log.info("engine=vllm: stitching %s into a copy of %s for vLLM (%s)", head, target_folder, out / "engine_model")
    layers = mtp_folders.load_mtp(head)
    return str(mtp_folders.stitch(layers, target_folder, out / "engine_model", dtype=dtype,
                                  stage="eval"))


def stitched_to_serve(drafter) -> bool:
    """train's MTP output (the layers alone, architecture DraftsmithMTP as load_drafter read it): no engine serves it
    as it is, only stitched into a copy of its target (`export format=mimo`)."""
    return drafter.engines.in_target and drafter.info.get("architecture") == mtp_folders.MTP_ARCHITECTURE


def served_head(drafter) -> tuple[Optional[str], Optional[str]]:
    """(the folder the serving commands name for the head, the command that writes it; None where that folder is the
    head's own): train's MTP output (the layers alone) is served as its target with them stitched in, as `export
    format=mimo` writes it (in_target_model does the same for eval's own vLLM run)."""
    path = drafter.info.get("path")
    if path is None or not stitched_to_serve(drafter):
        return path, None
    out = f"{path}-mimo"
    return out, f"draftsmith export head={path} format=mimo out={out}"


def with_export_command(settings: dict, export: Optional[str]) -> dict:
    """`settings` (serving_settings') with `export` before each engine command that names the exported folder."""
    for key in ("vllm", "sglang"):
        if export and (settings.get(key) or {}).get("command"):
            settings[key]["export_command"] = export
    return settings


def engine_job(target_folder: str, prompts: list[list[int]], max_tokens: int, eos: list[int], runs: list[dict],
               dtype: str = "float32", repeats: int = 1, warmup: int = 1, batch: bool = False) -> dict:
    """vllm_worker.py's job: every prompt alone, greedy, `repeats` times (median), after `warmup` prompts; or, with
    `batch` (the tests' counters-only jobs), every prompt in one call, with no time measured."""
    if batch and (repeats != 1 or warmup != 0):
        raise ValueError("a batch job measures no time: repeats=1 and warmup=0")
    longest = max(len(p) for p in prompts) + max_tokens
    longest_draft = max([r.get("k") or 0 for r in runs] + [0])
    return {"target": target_folder, "dtype": dtype, "max_model_len": longest + longest_draft + 64,
            "kv_cache_bytes": KV_CACHE_BYTES, "prompts": prompts, "max_tokens": int(max_tokens),
            "stop_token_ids": list(eos), "repeats": int(repeats), "warmup": int(warmup), "batch": bool(batch),
            "runs": runs}


# --------------------------------------------------------------------------- counting as vLLM counts

def builtin_steps(sample: metrics.Sample) -> list[int]:
    """Draft tokens accepted by each verification that had a draft (the last one's from the untruncated count)."""
    emitted = sample.emitted_per_verification or []
    accepted = [e - 1 for e in emitted]
    if accepted:
        accepted[-1] = sum(sample.accepted) - sum(accepted[:-1])  # its emitted count was cut at EOS / the cap
    return [a for a, size in zip(accepted, sample.draft_sizes) if size > 0]


def builtin_counts(samples: list[metrics.Sample], num_speculative_tokens: int) -> dict:
    """The built-in decoder's acceptance as vLLM's counters would hold it."""
    per_pos = metrics.sum_positions([s.accepted for s in samples] + [[0] * num_speculative_tokens])
    return {"num_drafts": sum(1 for s in samples for size in s.draft_sizes if size > 0),
            "num_draft_tokens": sum(sum(s.draft_sizes) for s in samples),
            "num_accepted_tokens": sum(sum(s.accepted) for s in samples),
            "num_accepted_tokens_per_pos": per_pos[:num_speculative_tokens]}


def figures(counts: dict) -> dict:
    """τ (bonus included) and per-position acceptance from counter values, as vLLM computes them."""
    n = counts["num_drafts"]
    return {"tau": 1 + counts["num_accepted_tokens"] / n if n else 1.0,
            "per_position_acceptance": [a / n if n else 0.0 for a in counts["num_accepted_tokens_per_pos"]],
            **counts}


def steps_identical(builtin: list[int], engine_steps: list[int]) -> bool:
    """Every verification but the last of each side accepted as many tokens, and they verified as often (±1)."""
    n = min(len(builtin), len(engine_steps))
    return abs(len(builtin) - len(engine_steps)) <= 1 and builtin[: n - 1] == engine_steps[: n - 1]


def without_steps(counts: dict, removed: list[int], num_speculative_tokens: int) -> dict:
    """Counter values less some verifications (`removed`: the draft tokens each of them accepted)."""
    per_pos = (list(counts["num_accepted_tokens_per_pos"]) + [0] * num_speculative_tokens)[:num_speculative_tokens]
    for accepted in removed:
        for i in range(min(accepted, num_speculative_tokens)):
            per_pos[i] -= 1
    return {"num_drafts": counts["num_drafts"] - len(removed),
            "num_accepted_tokens": counts["num_accepted_tokens"] - sum(removed),
            "num_accepted_tokens_per_pos": per_pos}


def agreement(samples: list[metrics.Sample], run: dict, num_speculative_tokens: int,
              tolerance: float = TOLERANCE) -> dict:
    """The built-in decoder's samples against one engine run on the same prompts (vLLM's counting on both).

    Where the engine gave every prompt's per-step detail (vLLM's per-request counts), the figures are compared
    over every verification but each prompt's last: there the engine drafts K and drops what is past max_tokens
    while the built-in decoder shortens its draft, so that one may differ by design (a head that accepts most
    drafts moved the pooled τ by 0.026 over 48 tokens that way). Without that detail, pooled over all."""
    ours_all, theirs_all = builtin_counts(samples, num_speculative_tokens), run["counters"]
    steps = [(d or {}).get("per_step_accepted") for d in run.get("per_request") or []]
    same_steps = [steps_identical(builtin_steps(s), st) for s, st in zip(samples, steps) if st is not None]
    steps_fraction = sum(same_steps) / len(same_steps) if same_steps else None
    pooled_ours, pooled_theirs = figures(ours_all), figures(theirs_all)
    ours, theirs = pooled_ours, pooled_theirs
    detailed = len(steps) == len(samples) and all(st is not None for st in steps)
    if detailed:  # per prompt, the steps both sides had less the last of them (vLLM may have one more: steps_identical)
        ours_cut, theirs_cut = [], []
        for s, st in zip(samples, steps):
            assert st is not None  # `detailed`
            b = builtin_steps(s)
            n = max(min(len(b), len(st)) - 1, 0)
            ours_cut += b[n:]
            theirs_cut += st[n:]
        ours = figures(without_steps(ours_all, ours_cut, num_speculative_tokens))
        theirs = figures(without_steps(theirs_all, theirs_cut, num_speculative_tokens))
    pos_ours = ours["per_position_acceptance"]
    pos_theirs = (theirs["per_position_acceptance"] + [0.0] * num_speculative_tokens)[:num_speculative_tokens]
    deltas = [abs(ours["tau"] - theirs["tau"])] + [abs(a - b) for a, b in zip(pos_ours, pos_theirs)]
    return {"tau_builtin": pooled_ours["tau"], "tau_engine": pooled_theirs["tau"],  # every verification
            "per_position_builtin": pooled_ours["per_position_acceptance"],
            "per_position_engine": (pooled_theirs["per_position_acceptance"]
                                    + [0.0] * num_speculative_tokens)[:num_speculative_tokens],
            "num_drafts_builtin": pooled_ours["num_drafts"], "num_drafts_engine": pooled_theirs["num_drafts"],
            "compared": "every verification but each prompt's last" if detailed else "every verification",
            "tau_builtin_compared": ours["tau"], "tau_engine_compared": theirs["tau"],
            "max_abs_delta": max(deltas), "tolerance": tolerance,
            "steps_identical_fraction": steps_fraction,
            # the τ-equality check: the compared figures within the tolerance, and where vLLM gave its per-request
            # detail, every verification but the last of each prompt identical
            "equal": max(deltas) <= tolerance and steps_fraction in (None, 1.0)}


def sequential_fallback(run: dict) -> bool:
    """vLLM loaded a parallel-drafting folder (mask_hidden) but drafts one token per forward: the speculative
    config had no "parallel_drafting" (vLLM ignores the folder's own) and vLLM said so in one warning line."""
    return any(SEQUENTIAL_FALLBACK in line for line in run.get("warnings") or [])


# --------------------------------------------------------------------------- the report's section

def engine_report(setup, drafter, samples: dict[str, list[metrics.Sample]], report: dict, target_model: str,
                  engine_warning: Optional[Callable[[Any, dict], Optional[str]]] = None) -> dict:
    """Decode the eval's prompts in vLLM and return the report's `engine` (and the engine's recommendation);
    `target_model` is the target's name in the serving commands (its Hub id); `engine_warning`: the head's method's
    optional hook (its row's `engine_warning`), None for none."""
    cfg, d = setup.cfg, setup.drafting
    check_engine_options(cfg)
    base = samples[TARGET_ONLY]
    prompts = [s.prompt_ids for s in base]
    runs = engine_runs(cfg, drafter, d.num_speculative_tokens)
    dtype = str(setup.target.model.dtype).removeprefix("torch.")
    target_folder = served_target(setup.target)
    if drafter.engines.in_target:
        model = in_target_model(drafter, target_folder, Path(cfg.out), setup.target.model.dtype)
        for run in runs[1:]:
            if run["speculative_config"]["method"] == drafter.engines.vllm:
                run["model"] = model
    job = engine_job(target_folder, prompts, cfg.max_new_tokens, setup.target.eos_token_ids, runs,
                     dtype=dtype, repeats=cfg.repeats,
                     warmup=cfg.warmup_prompts)
    result = engine.run_job(job)
    section = {"name": "vllm", "version": result["vllm_version"], "torch": result["torch_version"],
               "python": str(engine.engine_python()), "target": job["target"], "dtype": job["dtype"],
               "counting": "vLLM's counters pooled over every verification that had a draft: tau = 1 + "
                           "num_accepted_tokens / num_drafts, per-position = num_accepted_tokens_per_pos / "
                           "num_drafts; the built-in decoder's figures beside them are counted the same way",
               "runs": {}}
    engine_base = result["runs"][TARGET_ONLY]
    if not engine_base.get("ok"):
        raise DraftsmithError(f"engine=vllm: vLLM could not run the target {job['target']}: {engine_base['error']}")
    base_tps = tokens_per_s(engine_base)
    section["target_only_tokens_per_s"] = base_tps
    section["target_only_identical_to_builtin"] = fraction_equal(engine_base["tokens"], [s.tokens for s in base])
    for run in runs[1:]:
        got = result["runs"][run["name"]]
        builtin = samples.get(run["name"])  # None: the built-in decoder did not run it
        section["runs"][run["name"]] = run_section(run, got, builtin, engine_base, base_tps, base)
        if run["speculative_config"]["method"] == "ngram" and cfg.ngram_match != "earliest":
            section["runs"][run["name"]]["note"] = ("the built-in n-gram copies after the latest match, vLLM's after "
                                                    "the earliest: ngram_match=earliest counts as vLLM does")
    add_method_warning(section, engine_warning, drafter, result)
    section["cost_model"] = engine_cost_model(section, drafter.method, report)
    main = section["runs"].get(drafter.method)
    if main is not None and main.get("loaded"):
        section.update({k: main[k] for k in ("tau", "per_position_acceptance", "speculative_tokens_per_s", "speedup",
                                             "greedy_identical_to_engine_target_only", "agreement")})
    out: dict[str, Any] = {"engine": section}
    rec = engine_recommendation(section, drafter, setup, report, target_model)
    if rec is not None:
        out["builtin_recommendation"] = report.get("recommendation")
        out["recommendation"] = rec
    return out


def add_method_warning(section: dict, engine_warning, drafter, result: dict) -> None:
    """The drafter's method's word on this engine's run (its optional hook `engine_warning(drafter, result)`): one
    line in the section's `warnings` and the log; nothing without the hook or where it returns None."""
    warning = engine_warning(drafter, result) if engine_warning is not None else None
    if warning is not None:
        section["warnings"] = [warning]
        log.warning(f"warning: {warning}")


def run_section(run: dict, got: dict, builtin: Optional[list[metrics.Sample]], engine_base: dict, base_tps: float,
                builtin_base: list[metrics.Sample]) -> dict:
    """One speculative run: refused (vLLM's sentence) or its figures, greedy check and agreement."""
    out = {"speculative_config": run["speculative_config"], "k": run.get("k")}
    if not got.get("ok"):
        return out | {"loaded": False, "refused": got.get("error")}
    tps = tokens_per_s(got)
    fig = figures(got["counters"])
    out |= {"loaded": True, "tau": fig["tau"], "per_position_acceptance": fig["per_position_acceptance"],
            "counters": got["counters"], "speculative_tokens_per_s": tps, "speedup": metrics.speedup(tps, base_tps),
            "greedy_identical_to_engine_target_only": fraction_equal(got["tokens"], engine_base["tokens"]),
            "greedy_identical_to_builtin_target_only": fraction_equal(got["tokens"], [s.tokens for s in builtin_base]),
            "parallel_drafting": (got.get("speculative") or {}).get("parallel_drafting"),
            "sequential_fallback": sequential_fallback(got)}
    if builtin is not None:
        out["agreement"] = agreement(builtin, got, run["k"])
        out["builtin_speedup"] = metrics.compare(builtin, builtin_base)["speedup"]
    return out


def tokens_per_s(run: dict) -> float:
    return metrics.tokens_per_s(sum(len(t) for t in run["tokens"]), sum(run["seconds"]))


def fraction_equal(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a) if a else 0.0


def engine_cost_model(section: dict, method: str, report: dict) -> Optional[dict]:
    """The cost model calibrated to the engine: vLLM's own seconds per target-only token and per speculative
    cycle at each K it decoded, and from them the speedup at every K up to the largest decoded one.

        speedup_engine(K) = tau(K) * t_step_engine / t_cycle_engine(K)
        t_step_engine = 1 / target-only tokens/s;  t_cycle_engine(K) = tau_engine(K) / speculative tokens/s

    The built-in decoder's cycle costs another share of its step than vLLM's on CPU (vLLM here steps the
    target on one core, its front end busy on the other, so its fixed per-step cost is larger and a verify
    pass of K+1 tokens costs relatively less): its own table predicts its own speedup, this one the engine's.
    K between decoded ones take t_cycle interpolated linearly; tau(K) from the built-in decoder's acceptance."""
    base_tps = section.get("target_only_tokens_per_s")
    measured = sorted((r["k"], r) for name, r in section["runs"].items()
                      if r.get("loaded") and r.get("speculative_tokens_per_s")
                      and (name == method or name.startswith(f"{method}@K=")))
    if not base_tps or not measured:
        return None
    t_step = 1.0 / base_tps
    cycle = {num_speculative_tokens: r["tau"] / r["speculative_tokens_per_s"] for num_speculative_tokens, r in measured}
    acceptance = (report.get("cost_model") or {}).get("acceptance_per_position") or report.get(
        "per_position_acceptance") or []
    builtin_rows = {row["k"]: row for row in (report.get("cost_model") or {}).get("table") or []}
    builtin_step = ((report.get("cost_model") or {}).get("target") or {}).get("step_s")
    decoded = sorted(cycle)
    rows = []
    for num_speculative_tokens in range(1, decoded[-1] + 1):
        if num_speculative_tokens in cycle:
            t_cycle = cycle[num_speculative_tokens]
        elif num_speculative_tokens < decoded[0]:
            continue
        else:  # between two decoded K
            lo = max(j for j in decoded if j < num_speculative_tokens)
            hi = min(j for j in decoded if j > num_speculative_tokens)
            t_cycle = cycle[lo] + (cycle[hi] - cycle[lo]) * (num_speculative_tokens - lo) / (hi - lo)
        tau = (predicted_tau(acceptance, num_speculative_tokens) if num_speculative_tokens <= len(acceptance)
               else None)
        run = dict(measured).get(num_speculative_tokens)
        b = builtin_rows.get(num_speculative_tokens) or {}
        rows.append({"k": num_speculative_tokens, "t_cycle_s": t_cycle, "cycle_over_step": t_cycle / t_step,
                     "predicted_tau": tau,
                     "predicted_speedup": tau * t_step / t_cycle if tau is not None else None,
                     "measured_tau": run["tau"] if run else None,
                     "measured_speedup": run["speedup"] if run else None,
                     "builtin_cycle_over_step": (b["t_verify_s"] + b["t_draft_s"]) / builtin_step
                                                if b and builtin_step else None,
                     "builtin_predicted_speedup": b.get("predicted_speedup"),
                     "builtin_measured_speedup": run.get("builtin_speedup") if run else None})
    return {"formula": "speedup(K) = tau(K) * t_step_engine / t_cycle_engine(K), vLLM's measured seconds",
            "t_step_s": t_step, "decoded_k": decoded, "table": rows}


def engine_recommendation(section: dict, drafter, setup, report: dict, target_model: str) -> Optional[dict]:
    """The K with the best speedup measured in vLLM, with the serving settings for it."""
    rows = [(r["k"], r["speedup"]) for name, r in section["runs"].items()
            if r.get("loaded") and (name == drafter.method or name.startswith(f"{drafter.method}@K="))]
    if not rows:
        return None
    num_speculative_tokens, best = max(rows, key=lambda kv: kv[1])
    builtin = report.get("recommendation") or {}
    settings = {key: builtin[key] for key in ("vllm", "sglang") if key in builtin}
    if builtin.get("k") != num_speculative_tokens or not settings:
        d = setup.drafting
        served, export = served_head(drafter)
        settings = with_export_command(serving_settings(drafter.method, drafter.engines, target_model, served,
                                                        num_speculative_tokens, d.mode, d.tree_top_k, None,
                                                        setup.cfg.ngram_min, setup.cfg.ngram_max), export)
    table = (section.get("cost_model") or {}).get("table") or []
    # the engine-calibrated model's
    predicted = next((r["predicted_speedup"] for r in table if r["k"] == num_speculative_tokens), None)
    return {"k": num_speculative_tokens, "mode": setup.drafting.mode, "measured_speedup": best, "measured_by": "vllm",
            "predicted_speedup": predicted, "predicted_by": "the cost model calibrated to vLLM's measured seconds",
            "faster_than_target_only": best > 1.0,
            **{key: settings[key] for key in ("vllm", "sglang")}}
