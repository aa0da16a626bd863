"""`draftsmith eval engine=llamacpp`: the same prompts decoded by llama-server, its figures beside the built-in
decoder's.

llama.cpp is the engine CPU users serve GGUF models in (draftsmith.core.llamacpp builds and runs it). This module
decodes an eval run's prompts there, one llama-server per run, and returns the report's `llamacpp` section:

    llamacpp_runs     target-only and n-gram lookup (ngram-simple) once; for each of eval's gguf_outtypes the
                      head at K (and every sweep_k) and head + n-gram (llama.cpp's mixing: the n-gram draft when
                      the context has a match, else the head's)
    target_gguf       what llama-server loads as the target: the target's own GGUF (the Q4_1 file the head was
                      trained on), or with llamacpp_target=f32|bf16 its dequantised weights converted
    head_gguf         the head written by `export format=gguf gguf_outtype=<t>` into a temporary folder, once per
                      out type t
    llamacpp_report   decode every run, then per run: greedy output, τ and per-position acceptance from
                      llama.cpp's counters, tokens/s from its clock, speedup against its target-only run; the
                      fastest run named

llama.cpp counts as vLLM does (draftsmith.core.llamacpp), so the built-in decoder's figures beside its are
counted by eval/engine_vllm.py's `builtin_counts` and compared by its `agreement`. llama.cpp gives no
per-request step detail, so the agreement is the pooled figures' alone.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from ..core import DraftsmithError, llamacpp
from ..core.artifacts import MANIFEST, read_manifest
from ..data_gen.target import cache_root, smollm2_gguf_path
from ..core.engine import served_folder
from . import metrics
from .cost import llamacpp_settings
from .engine_vllm import TARGET_ONLY, agreement, figures, fraction_equal, run_name
from .proposers.ngram import NGRAM_ENGINES
from .target_runner import divergence
from ..heads.folders import FormatOptions
from ..core.progress import progress

# --------------------------------------------------------------------------- what llama-server loads

def target_gguf(target, how: str) -> Path:
    """The target as llama-server loads it. `same`: the GGUF file the target was loaded from (draftsmith
    dequantised it; llama.cpp computes with the quantised blocks, so τ may differ a little), an HF target
    converted to f32. `f32` / `bf16`: the weights draftsmith computes with, converted (cached by the target's hash)."""
    name = str(target.target_id)
    if how == "same":
        if name == "smollm2":
            return smollm2_gguf_path()
        if name.endswith(".gguf"):
            return Path(name)
        how = "f32"
    cached = cache_root() / "llamacpp-targets" / f"{Path(name).name}-{target.target_hash}-{how}.gguf"
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        llamacpp.convert(Path(served_folder(target, "engine=llamacpp")), cached, how)
    return cached


def head_gguf(drafter, write_gguf, target, folder: Path, outtype: str) -> Path:
    """The head written by its method's gguf writer `write_gguf` (what `export format=gguf gguf_outtype=<outtype>`
    runs) into `folder`."""
    path = Path(drafter.info["path"])
    manifest_target = read_manifest(path).get("target") if (path / MANIFEST).is_file() else target.identity()
    options = FormatOptions(torch.float32, target_folder=lambda: Path(served_folder(target, "engine=llamacpp")),
                            gguf_outtype=outtype)
    write_gguf(drafter.model, folder, manifest_target, options)
    return next(folder.glob("*.gguf"))


# --------------------------------------------------------------------------- the runs

def outtype_name(method: str, outtype: str, outtypes: list[str]) -> str:
    """A head run's drafter as the report names it: `<method>-<out type>` when several GGUF types are measured side
    by side, the method alone when one is (the names reports had before gguf_outtypes)."""
    return method if len(outtypes) == 1 else f"{method}-{outtype}"


def llamacpp_runs(cfg, drafter, num_speculative_tokens: int) -> list[dict]:
    """Each run's name, K, head GGUF type (`gguf_outtype`, None without a head), the built-in decoder's run it is
    compared with (`builtin`) and llama-server's speculative flags (eval/cost.py `llamacpp_settings`): target-only
    and n-gram once, the head at K and every sweep_k and head + n-gram once per `cfg.gguf_outtypes`."""
    runs = [{"name": TARGET_ONLY, "flags": [], "draft": False, "gguf_outtype": None}]
    method = drafter.method.removeprefix("ngram+")
    if drafter.make is None:
        return runs
    ngram = {"name": "ngram", "builtin": "ngram", "k": num_speculative_tokens, "draft": False, "gguf_outtype": None,
             "flags": llamacpp_settings("ngram", NGRAM_ENGINES, num_speculative_tokens, cfg.ngram_max)["flags"]}
    if method == "ngram":
        return runs + [ngram]
    if drafter.engines.llamacpp is None:
        note = llamacpp_settings(method, drafter.engines, num_speculative_tokens)["note"]
        raise DraftsmithError(f"engine=llamacpp: {note}")
    p_min = cfg.drafting.stop_below  # llama.cpp's --spec-draft-p-min: the same rule (eval/cost.py)
    outtypes = cfg.gguf_outtypes
    for outtype in outtypes:
        for swept in dict.fromkeys([num_speculative_tokens, *cfg.sweep_k]):
            runs.append({"name": run_name(outtype_name(method, outtype, outtypes), swept, num_speculative_tokens),
                         "builtin": run_name(method, swept, num_speculative_tokens), "k": swept, "draft": True,
                         "gguf_outtype": outtype,
                         "flags": llamacpp_settings(method, drafter.engines, swept, cfg.ngram_max,
                                                    stop_below=p_min)["flags"]})
    runs.append(ngram)
    for outtype in outtypes:
        runs.append({"name": f"ngram+{outtype_name(method, outtype, outtypes)}", "builtin": f"ngram+{method}",
                     "k": num_speculative_tokens, "draft": True, "gguf_outtype": outtype,
                     "flags": llamacpp_settings(method, drafter.engines, num_speculative_tokens, cfg.ngram_max,
                                                ngram_first=True, stop_below=p_min)["flags"]})
    return runs


def decode_run(model: Path, draft: Optional[Path], run: dict, prompts: list[list[int]], max_tokens: int,
               repeats: int, warmup: int, threads: int, ctx: int) -> dict:
    """One llama-server: `warmup` prompts untimed, then every prompt `repeats` times (its median seconds; tokens
    and counters from the first)."""
    with llamacpp.Server(str(model), str(draft) if run["draft"] else None, run["flags"], threads=threads, ctx=ctx,
                         what=f"engine=llamacpp ({run['name']})") as server:
        for p in prompts[:warmup]:
            server.complete(p, max_tokens)
        tokens: list[list[int]] = []
        seconds: list[float] = []
        counters: list[dict] = []
        for p in prompts:
            results = [server.complete(p, max_tokens) for _ in range(repeats)]
            tokens.append(results[0]["tokens"])
            seconds.append(statistics.median(r["seconds"] for r in results))
            counters.append(results[0].get("counters") or {})  # {}: a server without a drafter counts nothing
    out: dict[str, Any] = {"tokens": tokens, "seconds": seconds}
    if run["flags"]:
        out["counters"] = pooled(counters)
        out["per_prompt_counters"] = counters  # the agreement leaves out prompts that left target-only's output
    return out


def pooled(counters: list[dict]) -> dict:
    n = max([len(c["num_accepted_tokens_per_pos"]) for c in counters] + [0])
    return {key: sum(c[key] for c in counters) for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")} | {
        "num_accepted_tokens_per_pos": [sum((c["num_accepted_tokens_per_pos"] + [0] * n)[i] for c in counters)
                                        for i in range(n)]}


# --------------------------------------------------------------------------- the report's section

def llamacpp_report(setup, drafter, samples: dict[str, list[metrics.Sample]], report: dict, write_gguf=None) -> dict:
    """Decode the eval's prompts in llama-server; the report's `llamacpp` section and llama.cpp's recommendation.
    `write_gguf`: the head's method's gguf format writer (its row's FORMATS["gguf"]), for a head folder."""
    cfg, d = setup.cfg, setup.drafting
    missing = llamacpp.llamacpp_missing()
    if missing:
        raise DraftsmithError(f"engine=llamacpp: {missing}.")
    base = samples[TARGET_ONLY]
    prompts = [s.prompt_ids for s in base]
    num_speculative_tokens = d.num_speculative_tokens
    runs = llamacpp_runs(cfg, drafter, num_speculative_tokens)
    how = cfg.llamacpp_target
    model = target_gguf(setup.target, how)
    ctx = max(len(p) for p in prompts) + cfg.max_new_tokens + max([r.get("k") or 0 for r in runs]) + 64
    threads = torch.get_num_threads()  # the built-in decoder's: the same cores on both sides
    outtypes = list(dict.fromkeys(r["gguf_outtype"] for r in runs if r["draft"]))
    results = {}
    with tempfile.TemporaryDirectory(prefix="draftsmith-llamacpp-") as tmp:
        if outtypes and write_gguf is None:
            raise DraftsmithError(f"engine=llamacpp: {drafter.method} heads have no GGUF format.")
        # each type written once, as `export format=gguf gguf_outtype=<type>` writes it; every run of that type loads it
        drafts = {t: head_gguf(drafter, write_gguf, setup.target, Path(tmp) / f"head-{t}", t) for t in outtypes}
        for run in progress(runs, desc="llama.cpp", unit="run", enabled=cfg.progress):
            results[run["name"]] = decode_run(model, drafts.get(run["gguf_outtype"]), run, prompts,
                                              cfg.max_new_tokens, cfg.repeats, cfg.warmup_prompts, threads, ctx)
    engine_base = results[TARGET_ONLY]
    base_tps = tps(engine_base)
    converted = model.parent.name == "llamacpp-targets"
    # the target converted from the weights draftsmith computes with, and a head (if any) at that same type: the τ
    # agreement is expected to hold; a GGUF served as it is (Q4_1), or a head at another type (q8_0 rounds its
    # weights), computes another function, and its agreement is a reading, not a check. Per run; the section's is
    # the evaluated drafter's run's
    own_type = "bf16" if how == "bf16" else "f32"
    section = {"name": "llamacpp", "version": f"{llamacpp.VERSION}-{llamacpp.COMMIT}", "target": str(model),
               "target_weights": how, "head_gguf_outtypes": outtypes, "threads": threads,
               "same_function_as_builtin": converted,
               "counting": "llama-server's Prometheus counters per request: tau = 1 + accepted / drafts (a "
                           "verification with a draft is one draft), per-position = accepted at i / drafts; the "
                           "built-in decoder's figures beside them are counted the same way",
               "target_only_tokens_per_s": base_tps,
               "target_only_identical_to_builtin": fraction_equal(engine_base["tokens"], [s.tokens for s in base]),
               "target_only_divergences": divergences(setup.runner, prompts, [s.tokens for s in base],
                                                      engine_base["tokens"]),
               "near_tie_eps": cfg.near_tie_eps,
               "runs": {}}
    for run in runs[1:]:
        got = results[run["name"]]
        fig = figures(got["counters"])
        r = {"k": run["k"], "gguf_outtype": run["gguf_outtype"], "flags": run["flags"], "tau": fig["tau"],
             "per_position_acceptance": (fig["per_position_acceptance"] + [0.0] * run["k"])[: run["k"]],
             "counters": got["counters"], "speculative_tokens_per_s": tps(got),
             "speedup": metrics.speedup(tps(got), base_tps),
             "greedy_identical_to_engine_target_only": fraction_equal(got["tokens"], engine_base["tokens"]),
             "greedy_identical_to_builtin_target_only": fraction_equal(got["tokens"], [s.tokens for s in base]),
             "divergences": divergences(setup.runner, prompts, engine_base["tokens"], got["tokens"])}
        r["greedy_identical_up_to_near_ties"] = up_to_near_ties(r["divergences"], len(prompts), cfg.near_tie_eps)
        r["same_function_as_builtin"] = converted and run["gguf_outtype"] in (None, own_type)
        builtin = samples.get(run["builtin"])  # the same drafter and K in the built-in decoder, whatever the type
        if builtin is not None:
            r["builtin_speedup"] = metrics.compare(builtin, base)["speedup"]
            if not run["name"].startswith("ngram"):  # llama.cpp's ngram-simple matches one length, ours several
                r["agreement"] = agreement_where_identical(builtin, got, engine_base["tokens"], run["k"])
        section["runs"][run["name"]] = r
    if section["runs"]:
        section["fastest"] = fastest(section["runs"])
    # the evaluated drafter's own run (ngram+<m>: the mixed one) at K, at the first out type
    main = next((section["runs"][run["name"]] for run in runs[1:] if run["builtin"] == drafter.method), None)
    if main is not None:
        section.update({key: main[key] for key in ("tau", "per_position_acceptance", "speedup",
                                                   "same_function_as_builtin") if key in main})
        if "agreement" in main:
            section["agreement"] = main["agreement"]
    out: dict[str, Any] = {"llamacpp": section}
    rec = recommendation(section, drafter, cfg)
    if rec is not None:
        out["builtin_recommendation"] = report.get("recommendation")
        out["recommendation"] = rec
    return out


def divergences(runner, prompts: list[list[int]], reference: list[list[int]], got: list[list[int]]) -> list[dict]:
    """Every prompt whose greedy output `got` leaves `reference`: where, and the built-in target's top-2 margin
    there. llama.cpp is not batch-invariant: its F32 matmul sums in another order over K+1 rows than over one, so a
    verification can flip a near-tie that a one-token step resolved the other way (measured: a margin of 0.0067
    logits on SmolLM2, 2026-12-05). A divergence at a wide margin is a decoder error."""
    return [{"prompt": i, **divergence(runner, p, a, b)}
            for i, (p, a, b) in enumerate(zip(prompts, reference, got)) if a != b]


def up_to_near_ties(divergences: list[dict], n: int, eps: float) -> float:
    """The fraction of n prompts identical, or whose first divergence is at a near-tie (margin below eps)."""
    return (n - sum(d["margin"] >= eps for d in divergences)) / n if n else 1.0


def agreement_where_identical(builtin: list[metrics.Sample], got: dict, reference: list[list[int]],
                              num_speculative_tokens: int) -> dict:
    """eval/engine_vllm.py's `agreement` over the prompts whose llama.cpp output equals its target-only output
    (past a divergence the two decoders draft from different contexts); `prompts_compared` says how many."""
    keep = [i for i, (a, b) in enumerate(zip(got["tokens"], reference)) if a == b]
    compared = f"{len(keep)}/{len(reference)}"
    counters = got["per_prompt_counters"]
    if not keep:  # nothing left to compare: the pooled figures beside each other, and never "equal"
        return (agreement(builtin, {"counters": pooled(counters)}, num_speculative_tokens)
                | {"equal": False, "prompts_compared": compared})
    agree = agreement([builtin[i] for i in keep], {"counters": pooled([counters[i] for i in keep])},
                      num_speculative_tokens)
    return agree | {"prompts_compared": compared}


def tps(run: dict) -> float:
    return metrics.tokens_per_s(sum(len(t) for t in run["tokens"]), sum(run["seconds"]))


def fastest(runs: dict[str, dict]) -> str:
    """The run of the highest speedup against llama.cpp's target-only run."""
    return max(runs, key=lambda name: runs[name]["speedup"])


def recommendation(section: dict, drafter, cfg) -> Optional[dict]:
    """llama.cpp's measured best of every speculative run (the head at each K and GGUF type, n-gram, head +
    n-gram), with its llama-server command and, for a head, the export command that writes its GGUF type."""
    if not section["runs"]:
        return None
    name = fastest(section["runs"])
    best = section["runs"][name]
    method = drafter.method.removeprefix("ngram+")
    mixed = name.startswith("ngram+")
    engines = NGRAM_ENGINES if name == "ngram" else drafter.engines
    settings = llamacpp_settings("ngram" if name == "ngram" else method, engines, best["k"], cfg.ngram_max,
                                 ngram_first=mixed, stop_below=cfg.drafting.stop_below)
    if settings.get("command"):  # the target this eval served; the head as `draftsmith export format=gguf` writes it
        settings["command"] = settings["command"].replace("<target>.gguf", section["target"])
        if "<head>.gguf" in settings["command"]:
            out = f"{drafter.info.get('path')}-gguf"
            settings["export_command"] = (f"draftsmith export head={drafter.info.get('path')} format=gguf "
                                          f"gguf_outtype={best['gguf_outtype']} out={out}")
            settings["command"] = settings["command"].replace("<head>.gguf", f"{out}/{method}.gguf")
    return {"k": best["k"], "mode": "chain", "drafter": name, "measured_speedup": best["speedup"],
            "measured_by": "llamacpp", "predicted_speedup": None, "faster_than_target_only": best["speedup"] > 1.0,
            "llamacpp": settings}
