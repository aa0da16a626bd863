"""(slow) Every GGUF export in llama.cpp: llama-server loads each `export format=gguf`, decodes the same prompts
greedily, and measures what the built-in decoder measures.

The session's heads (conftest.py `engine_head`, trained once on `engine_data`) are exported as GGUF (EAGLE-3 and
the draft model: the two methods llama.cpp has a loader for that read our folders; P-EAGLE and DFlash are refused
in one sentence, tests/test_llamacpp.py). The target is SmolLM2's weights as draftsmith computes with them (the
dequantised GGUF converted to F32), so that Q4_1 kernel rounding does not blur the check; a Q4_1 reading stands
beside it. One llama-server per run (about a second to start). llama.cpp is built by `bash scripts/setup.sh
--engine`; without it these tests skip with the sentence that says so, and fail where DRAFTSMITH_REQUIRE_ENGINE=1.

What is asserted, for each GGUF export: llama.cpp's output is token-identical to llama.cpp target-only and to
draftsmith's target-only, or leaves it only at a near-tie (the target's top-2 logits closer than FP32_NEAR_TIE
there: llama.cpp is not batch-invariant, its F32 kernels sum K+1 rows in another order than one, and a
verification flipped a 0.0067-logit tie on 2026-12-05); llama.cpp's τ and per-position acceptance (its counters,
pooled over every verification with a draft of the prompts left identical) equal the built-in decoder's counted the
same way within TOLERANCE (0.02). A broken copy (d2t zeroed with the draft rows reversed, aux layers shifted) must
fail the τ check.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import ENGINE_K

from draftsmith.core import engine, llamacpp
from draftsmith.configs import compose
from draftsmith.data_gen.target import smollm2_gguf_path
from draftsmith.eval import engine_llamacpp as ll
from draftsmith.eval import run as ev
from draftsmith.eval.engine_vllm import TARGET_ONLY, figures
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.export import run as export
from draftsmith.core.methods import methods

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(3600)]

K = ENGINE_K
MAX_TOKENS = 48
FP32_NEAR_TIE = 0.05  # logits: a divergence of an F32 llama.cpp from F32 target-only is a near-tie below this
Q4_NEAR_TIE = 0.25  # on the Q4_1 file llama.cpp also rounds the activations to 8 bits (eval's bf16 default)
COMMON = ["target=smollm2", "target.dtype=float32"]
HEADS = ("eagle3", "draft")  # the methods llama.cpp serves from our folders
BROKEN = ("eagle3_d2t_zeroed", "eagle3_aux_layers_shifted")


def d2t_zeroed_in_reverse_order(tensors: dict) -> dict:
    """d2t zeroed in the same head with its draft rows reversed (lm_head's rows and d2t re-indexed alike are the same
    function; d2t is then zeroed, so that row i names target token i). SmolLM2's BPE ids run roughly by frequency:
    the engine heads' 8192-token draft vocabulary is ids 0..8113 plus 78 others, so its own d2t is already 0 on 8114
    rows, and zeroing it moves only drafts of the 78 (the DSpark control of tests/test_engine_llamacpp_block.py did
    not move τ that way on 2026-12-06). Reversed, no row's offset is 0."""
    vd = tensors["d2t"].numel()
    order = torch.arange(vd - 1, -1, -1)
    return tensors | {"lm_head.weight": tensors["lm_head.weight"][order].contiguous(),
                      "d2t": torch.zeros_like(tensors["d2t"])}


@pytest.fixture(scope="module")
def ggufs(llamacpp_ready, engine_head, smollm2_target, tmp_path_factory):
    """name -> GGUF file: each head's `export format=gguf gguf_outtype=f32`, the broken copies, and the F32 target."""
    root = tmp_path_factory.mktemp("llamacpp")
    out = {"root": root}
    for name in HEADS:
        folder = export(compose("export", [f"head={engine_head(name)}", "format=gguf", "gguf_outtype=f32",
                                           f"out={root / ('x-' + name)}"]))
        out[name] = next(folder.glob("*.gguf"))
    # the broken copies: the EAGLE-3 folder the gguf export converts, one thing llama.cpp reads made wrong
    folder = export(compose("export", [f"head={engine_head('eagle3')}", "format=eagle3", "dtype=float32",
                                       f"out={root / 'e3'}"]))
    target_dir = Path(engine.served_folder(smollm2_target, "test"))

    def broken(name: str, config: dict | None = None, tensors=None) -> Path:
        dst = shutil.copytree(folder, root / name)
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config or {})
        (dst / "config.json").write_text(json.dumps(cfg))
        if tensors is not None:
            save_file(tensors(load_file(dst / "model.safetensors")), str(dst / "model.safetensors"))
        return llamacpp.convert(dst, root / f"{name}.gguf", "f32", target_dir)

    out["eagle3_d2t_zeroed"] = broken("eagle3_d2t_zeroed", tensors=d2t_zeroed_in_reverse_order)
    out["eagle3_aux_layers_shifted"] = broken("eagle3_aux_layers_shifted",
                                              {"eagle_aux_hidden_state_layer_ids": [3, 16, 28]})  # 2, 15, 27 + 1
    out["target_f32"] = ll.target_gguf(smollm2_target, "f32")
    return out


@pytest.fixture(scope="module")
def measured(builtin_samples, ggufs):
    """(built-in samples per method, llama.cpp's runs by name): the same prompts, greedy, fp32 / F32, K = 3 (the
    built-in samples are the trained heads', conftest.py, shared with the vLLM module)."""
    samples = {m: builtin_samples(m, MAX_TOKENS) for m in (TARGET_ONLY, *HEADS)}
    prompts = [s.prompt_ids for s in samples[TARGET_ONLY]]
    ctx = max(len(p) for p in prompts) + MAX_TOKENS + 64

    def run(target: Path, draft: str | None, flags: list[str]) -> dict:
        spec = {"name": draft or TARGET_ONLY, "flags": flags, "draft": draft is not None}
        return ll.decode_run(target, ggufs[draft] if draft else None, spec, prompts, MAX_TOKENS, repeats=1, warmup=0,
                             threads=torch.get_num_threads(), ctx=ctx)

    def flags(method: str) -> list[str]:
        return ll.llamacpp_settings(method, methods()[method].engines, K)["flags"]

    runs = {TARGET_ONLY: run(ggufs["target_f32"], None, [])}
    for name in HEADS:
        runs[name] = run(ggufs["target_f32"], name, flags(name))
    for name in BROKEN:
        runs[name] = run(ggufs["target_f32"], name, flags("eagle3"))
    q4 = smollm2_gguf_path()  # the file the heads were trained on, as llama.cpp computes with it
    runs["q4_1_target_only"] = run(q4, None, [])
    runs["q4_1_eagle3"] = run(q4, "eagle3", flags("eagle3"))
    return samples, runs


@pytest.fixture(scope="module")
def lossless(measured, smollm2_target):
    """lossless(reference, got, eps, record) asserts every prompt's greedy output `got` equals `reference` or first
    leaves it at a near-tie of the built-in fp32 target (top-2 margin below eps); the divergences go to `record`."""
    samples, _ = measured
    prompts = [s.prompt_ids for s in samples[TARGET_ONLY]]
    runner = TargetRunner(smollm2_target.model, max(len(p) for p in prompts) + MAX_TOKENS + 8)

    def check(reference: list[list[int]], got: list[list[int]], eps: float, record) -> None:
        found = ll.divergences(runner, prompts, reference, got)
        record("divergences", found)
        assert all(d["margin"] < eps for d in found), found

    return check


def test_f32_target_only_identical_to_builtin(measured, lossless, record_property):
    samples, runs = measured
    lossless([s.tokens for s in samples[TARGET_ONLY]], runs[TARGET_ONLY]["tokens"], FP32_NEAR_TIE, record_property)


def agreement(samples, runs: dict, name: str) -> dict:
    """The built-in τ against llama.cpp's over the prompts its run left identical to its target-only output."""
    agree = ll.agreement_where_identical(samples, runs[name], runs[TARGET_ONLY]["tokens"], K)
    assert 2 * int(agree["prompts_compared"].split("/")[0]) >= len(samples), agree  # most prompts compared
    return agree


@pytest.mark.parametrize("name", HEADS)
def test_gguf_export_in_llamacpp(measured, lossless, name, record_property):
    """Loads, greedy output identical to target-only (up to F32 near-ties), τ and per-position acceptance equal to
    the built-in's."""
    samples, runs = measured
    lossless(runs[TARGET_ONLY]["tokens"], runs[name]["tokens"], FP32_NEAR_TIE, record_property)
    agree = agreement(samples[name], runs, name)
    record_property("tau_llamacpp_builtin", [round(agree["tau_engine"], 4), round(agree["tau_builtin"], 4)])
    assert agree["equal"], agree
    assert agree["per_position_engine"][0] > 0.2, agree  # a trained head: drafts are accepted, the check means something


@pytest.mark.parametrize("name", BROKEN)
def test_broken_gguf_fails_tau_equality(measured, lossless, name, record_property):
    """Negative controls: llama.cpp loads each broken copy, still lossless, and its τ no longer equals the built-in's."""
    samples, runs = measured
    lossless(runs[TARGET_ONLY]["tokens"], runs[name]["tokens"], FP32_NEAR_TIE, record_property)
    agree = agreement(samples["eagle3"], runs, name)
    record_property("tau_llamacpp_builtin", [round(agree["tau_engine"], 4), round(agree["tau_builtin"], 4)])
    assert not agree["equal"], agree


def test_q4_1_target_lossless_and_its_tau_reported(measured, lossless, record_property):
    """On the Q4_1 file itself llama.cpp computes another function (quantised blocks): lossless against its own
    target-only decode (up to near-ties); the τ difference from the built-in decoder (on the dequantised weights) is
    reported."""
    samples, runs = measured
    lossless(runs["q4_1_target_only"]["tokens"], runs["q4_1_eagle3"]["tokens"], Q4_NEAR_TIE, record_property)
    tau_q4 = figures(runs["q4_1_eagle3"]["counters"])["tau"]
    tau_builtin = agreement(samples["eagle3"], runs, "eagle3")["tau_builtin"]
    record_property("q4_1_tau_minus_builtin", round(tau_q4 - tau_builtin, 4))
    assert tau_q4 > 1.2, (tau_q4, tau_builtin)  # the head drafts for the quantised target too


def test_eval_engine_llamacpp(engine_data, engine_head, llamacpp_ready, tmp_path):
    """`draftsmith eval engine=llamacpp`: target-only, the head, n-gram and head + n-gram in llama-server; the report's
    llamacpp section beside the built-in figures, and the recommendation from llama.cpp's measured best."""
    report = ev.run(compose("eval", COMMON + [f"head={engine_head('eagle3')}", "engine=llamacpp", "llamacpp_target=f32",
                                              "gguf_outtypes=[f32]",
                                              "prompts.source=holdout", f"prompts.path={engine_data}",
                                              "prompts.holdout=3", "max_new_tokens=32", "repeats=1", "warmup_prompts=0",
                                              "cost_repeats=1", "progress=false",
                                              "plot=false", f"drafting.num_speculative_tokens={K}", f"out={tmp_path}"]))
    e = report["llamacpp"]
    assert e["head_gguf_outtypes"] == ["f32"] and e["runs"]["eagle3"]["gguf_outtype"] == "f32"
    assert e["same_function_as_builtin"] and all(d["margin"] < FP32_NEAR_TIE for d in e["target_only_divergences"])
    assert set(e["runs"]) == {"eagle3", "ngram", "ngram+eagle3"}
    for name, run in e["runs"].items():  # identical, or a near-tie (FP32_NEAR_TIE, above) where it leaves
        assert all(d["margin"] < FP32_NEAR_TIE for d in run["divergences"]), (name, run["divergences"])
        assert run["greedy_identical_up_to_near_ties"] == 1.0, name
    assert e["runs"]["eagle3"]["agreement"]["equal"], e["runs"]["eagle3"]["agreement"]
    assert e["runs"]["ngram+eagle3"]["counters"]["num_drafts"] > 0
    rec = report["recommendation"]
    best = max(e["runs"], key=lambda n: e["runs"][n]["speedup"])
    assert rec["measured_by"] == "llamacpp" and rec["drafter"] == best
    assert rec["llamacpp"]["command"].startswith("llama-server -m ") and "--parallel 1" in rec["llamacpp"]["command"]
    md = (tmp_path / "report.md").read_text()
    assert "## llama.cpp" in md and "ngram+eagle3" in md


# --------------------------------------------------------------------------- the files, read back

def gguf_fields(gguf, path: Path) -> dict:
    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}


def test_eagle3_gguf_reads_back_with_its_target_layers(ggufs, llamacpp_gguf, smollm2_target):
    """What llama.cpp's EAGLE-3 loader reads: the arch, the target layers (HF hidden_states indices: llama.cpp
    captures each layer's input) and the target's hidden size, in F32 as exported."""
    out = ggufs["eagle3"].parent
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "gguf" and manifest["gguf"] == "eagle3.gguf" and manifest["gguf_outtype"] == "f32"
    assert manifest["counts"]["bytes"] == ggufs["eagle3"].stat().st_size
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["eagle3.gguf", "manifest.json"]
    gguf = llamacpp_gguf
    fields = gguf_fields(gguf, ggufs["eagle3"])
    arch = fields[gguf.Keys.General.ARCHITECTURE]
    assert arch == "eagle3"
    assert fields[gguf.Keys.LLM.TARGET_LAYERS.format(arch=arch)] == [2, 15, 27]  # SmolLM2's 30 layers: the default
    assert fields[gguf.Keys.LLM.TARGET_HIDDEN_SIZE.format(arch=arch)] == smollm2_target.hidden_size
    assert fields[gguf.Keys.General.FILE_TYPE] == gguf.LlamaFileType.ALL_F32
    shifted = gguf_fields(gguf, ggufs["eagle3_aux_layers_shifted"])
    assert shifted[gguf.Keys.LLM.TARGET_LAYERS.format(arch=arch)] == [3, 16, 28]


def test_draft_gguf_reads_back_as_llama_and_a_second_export_replaces_it(ggufs, llamacpp_gguf, engine_head):
    out = ggufs["draft"].parent
    gguf = llamacpp_gguf
    fields = gguf_fields(gguf, ggufs["draft"])
    arch = fields[gguf.Keys.General.ARCHITECTURE]
    assert arch == "llama"
    layers = json.loads((engine_head("draft") / "config.json").read_text())["num_hidden_layers"]
    assert fields[gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)] == layers
    again = shutil.copytree(out, ggufs["root"] / "draft-again")  # the module's folder stays as it was
    before = (again / "draft.gguf").stat().st_size
    assert export(compose("export", [f"head={engine_head('draft')}", "format=gguf", "gguf_outtype=bf16",
                                     f"out={again}"])) == again
    after = (again / "draft.gguf").stat().st_size
    assert after < before  # bf16 weights in place of f32 ones
    manifest = json.loads((again / "manifest.json").read_text())
    assert manifest["counts"]["bytes"] == after and manifest["gguf_outtype"] == "bf16"
    assert gguf_fields(gguf, again / "draft.gguf")[gguf.Keys.General.FILE_TYPE] == gguf.LlamaFileType.MOSTLY_BF16
    assert not [p for p in again.parent.iterdir() if p.name.startswith(".draft-again")]  # no temporary beside it
