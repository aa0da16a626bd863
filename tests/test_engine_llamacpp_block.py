"""(slow) The block drafters' GGUF exports in llama.cpp: DFlash (`--spec-type draft-dflash`) and DSpark
(`--spec-type draft-dspark`), each `export format=gguf gguf_outtype=f32` of the session's trained head (conftest.py
`engine_head`), loaded by llama-server beside the F32 SmolLM2 target and decoding ENGINE_PROMPTS prompts greedily at
K = ENGINE_K, as tests/test_engine_llamacpp.py does for EAGLE-3 and the draft model (its helpers are the package's:
eval/engine_llamacpp.py `decode_run`, `divergences`, `agreement_where_identical`).

What is asserted, for each export: llama.cpp's greedy output equals its target-only output (or leaves it only at an
F32 near-tie: llama.cpp is not batch-invariant), and its τ and per-position acceptance (its counters, pooled over the
prompts left identical) equal the built-in decoder's within eval's TOLERANCE (0.02).

The stop rule: llama.cpp runs at `--spec-draft-p-min 0` (its default, passed explicitly) and the built-in decoder at
drafting.stop_below = 0 (its default): neither truncates a draft, so both verify K tokens a cycle. (At p-min > 0
draft-dspark stops on the confidence head, as drafting.stop_below does, but draft-dflash on the top probability among
its 10 best, renormalised: not the built-in rule.)

Negative controls, each a copy of the DSpark folder the export converts with one thing llama.cpp reads made wrong,
converted by the same converter: the Markov weights zeroed, the layout flipped (`sample_from_anchor: true`), `d2t`
zeroed. Each loads and stays lossless, and each MUST fail the τ agreement: the check sees what it claims to see.
`d2t` is zeroed in the same drafter with its draft rows in reverse order (lm_head, markov_w2 and d2t re-indexed
alike: the same function): SmolLM2's BPE ids run roughly by frequency, so the 8192-token draft vocabulary is ids
0..8113 plus 78 others and its own d2t is already 0 on 8114 rows; zeroed as it is, only drafts of the 78 would
move (on 2026-12-06 none of the prompts' accepted drafts was one of them, and τ did not move). Reversed, no row's
offset is 0.

One llama-server per run (target-only, the two exports, the three controls); MAX_TOKENS as the sibling module's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import ENGINE_K

from draftsmith.configs import compose
from draftsmith.core import engine, llamacpp
from draftsmith.core.methods import methods
from draftsmith.eval import engine_llamacpp as ll
from draftsmith.eval.engine_vllm import TARGET_ONLY
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.export import run as export

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(3600)]

K = ENGINE_K
MAX_TOKENS = 48
FP32_NEAR_TIE = 0.05  # logits: as tests/test_engine_llamacpp.py (an F32 llama.cpp leaves F32 target-only only there)
HEADS = ("dflash", "dspark")
BROKEN = ("dspark_markov_zeroed", "dspark_layout_flipped", "dspark_d2t_zeroed")


def spec_flags(method: str) -> list[str]:
    """llama-server's flags for the method's row (eval/cost.py `llamacpp_settings`: its spec type, K drafted tokens
    a cycle), with llama.cpp's default p-min 0 passed explicitly: no truncation (the module docstring's stop rule)."""
    return ll.llamacpp_settings(method, methods()[method].engines, K)["flags"] + ["--spec-draft-p-min", "0"]


def test_the_rows_serve_them_as_llama_cpp_names_them():
    assert [methods()[m].engines.llamacpp for m in HEADS] == ["draft-dflash", "draft-dspark"]


def reversed_draft_rows(tensors: dict) -> dict:
    """The same drafter with its draft vocabulary in reverse order: the rows of lm_head and markov_w2 reversed and d2t
    re-indexed so that row i still names the target token it named (the module docstring says why)."""
    vd = tensors["d2t"].numel()
    order = torch.arange(vd - 1, -1, -1)
    target_ids = tensors["d2t"] + torch.arange(vd)
    return tensors | {"lm_head.weight": tensors["lm_head.weight"][order].contiguous(),
                      "markov_head.markov_w2.weight": tensors["markov_head.markov_w2.weight"][order].contiguous(),
                      "d2t": target_ids[order] - torch.arange(vd)}


@pytest.fixture(scope="module")
def ggufs(llamacpp_ready, engine_head, smollm2_target, tmp_path_factory):
    """name -> GGUF file: each head's `export format=gguf gguf_outtype=f32`, the broken DSpark copies, the F32
    target."""
    root = tmp_path_factory.mktemp("llamacpp-block")
    out = {}
    for name in HEADS:
        folder = export(compose("export", [f"head={engine_head(name)}", "format=gguf", "gguf_outtype=f32",
                                           f"out={root / ('x-' + name)}"]))
        out[name] = folder / f"{name}.gguf"
    # the folder format=gguf hands the converter (draftsmith's DSpark folder), then one thing in it made wrong
    source = export(compose("export", [f"head={engine_head('dspark')}", "format=dspark", "dtype=float32",
                                       f"out={root / 'dspark'}"]))
    target_dir = Path(engine.served_folder(smollm2_target, "test"))

    def broken(name: str, config: dict | None = None, tensors=None) -> Path:
        dst = shutil.copytree(source, root / name)
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(cfg | (config or {})))
        if tensors is not None:
            save_file(tensors(load_file(dst / "model.safetensors")), str(dst / "model.safetensors"))
        return llamacpp.convert(dst, root / f"{name}.gguf", "f32", target_dir)

    zero = lambda *names: lambda s: s | {n: torch.zeros_like(s[n]) for n in names}  # noqa: E731
    out["dspark_markov_zeroed"] = broken("dspark_markov_zeroed",
                                         tensors=zero("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"))
    out["dspark_layout_flipped"] = broken("dspark_layout_flipped", {"sample_from_anchor": True})
    out["dspark_d2t_zeroed"] = broken("dspark_d2t_zeroed", tensors=lambda s: zero("d2t")(reversed_draft_rows(s)))
    out["target_f32"] = ll.target_gguf(smollm2_target, "f32")
    return out


@pytest.fixture(scope="module")
def measured(builtin_samples, ggufs):
    """(built-in samples per method, llama.cpp's runs by name): the same prompts, greedy, fp32 / F32, K = 3."""
    samples = {m: builtin_samples(m, MAX_TOKENS) for m in (TARGET_ONLY, *HEADS)}
    prompts = [s.prompt_ids for s in samples[TARGET_ONLY]]
    ctx = max(len(p) for p in prompts) + MAX_TOKENS + 64

    def run(name: str, flags: list[str]) -> dict:
        draft = ggufs[name] if flags else None
        spec = {"name": name, "flags": flags, "draft": draft is not None}
        return ll.decode_run(ggufs["target_f32"], draft, spec, prompts, MAX_TOKENS, repeats=1, warmup=0,
                             threads=torch.get_num_threads(), ctx=ctx)

    runs = {TARGET_ONLY: run(TARGET_ONLY, [])}
    for name in HEADS:
        runs[name] = run(name, spec_flags(name))
    for name in BROKEN:
        runs[name] = run(name, spec_flags("dspark"))
    return samples, runs


@pytest.fixture(scope="module")
def lossless(measured, smollm2_target):
    """lossless(reference, got, record) asserts every prompt's greedy output `got` equals `reference` or first
    leaves it at a near-tie of the built-in fp32 target (top-2 margin below FP32_NEAR_TIE)."""
    samples, _ = measured
    prompts = [s.prompt_ids for s in samples[TARGET_ONLY]]
    runner = TargetRunner(smollm2_target.model, max(len(p) for p in prompts) + MAX_TOKENS + 8)

    def check(reference: list[list[int]], got: list[list[int]], record) -> None:
        found = ll.divergences(runner, prompts, reference, got)
        record("divergences", found)
        assert all(d["margin"] < FP32_NEAR_TIE for d in found), found

    return check


def agreement(builtin, runs: dict, name: str) -> dict:
    """The built-in τ against llama.cpp's over the prompts its run left identical to its target-only output."""
    agree = ll.agreement_where_identical(builtin, runs[name], runs[TARGET_ONLY]["tokens"], K)
    assert 2 * int(agree["prompts_compared"].split("/")[0]) >= len(builtin), agree  # most prompts compared
    return agree


@pytest.mark.parametrize("name", HEADS)
def test_block_gguf_export_in_llamacpp(measured, lossless, name, record_property):
    """Loads, greedy output identical to target-only (up to F32 near-ties), τ and per-position acceptance equal to
    the built-in decoder's."""
    samples, runs = measured
    lossless(runs[TARGET_ONLY]["tokens"], runs[name]["tokens"], record_property)
    agree = agreement(samples[name], runs, name)
    record_property("tau_llamacpp_builtin", [round(agree["tau_engine"], 4), round(agree["tau_builtin"], 4)])
    assert agree["equal"], agree
    assert agree["per_position_engine"][0] > 0.2, agree  # a trained drafter: drafts are accepted, the check bites


@pytest.mark.parametrize("name", BROKEN)
def test_broken_dspark_gguf_fails_tau_equality(measured, lossless, name, record_property):
    """Negative controls: llama.cpp loads each broken copy, still lossless, and its τ no longer equals the
    built-in's."""
    samples, runs = measured
    lossless(runs[TARGET_ONLY]["tokens"], runs[name]["tokens"], record_property)
    agree = agreement(samples["dspark"], runs, name)
    record_property("tau_llamacpp_builtin", [round(agree["tau_engine"], 4), round(agree["tau_builtin"], 4)])
    assert not agree["equal"], agree


# --------------------------------------------------------------------------- the files, read back

def gguf_fields(reader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.")}


@pytest.mark.parametrize("name", HEADS)
def test_block_gguf_reads_back_with_its_layout_vocab_map_and_heads(ggufs, llamacpp_gguf, engine_head, name):
    """What llama.cpp's loader and draft-dflash / draft-dspark read: the dflash arch, the target layers (HF
    hidden_states indices), the block size, the bonus-anchor layout, the absolute d2t of the reduced vocab, and the
    Markov and confidence tensors for DSpark only."""
    gguf = llamacpp_gguf
    out = ggufs[name].parent
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "gguf" and manifest["gguf"] == f"{name}.gguf" and manifest["gguf_outtype"] == "f32"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [f"{name}.gguf", "manifest.json"]
    reader = gguf.GGUFReader(ggufs[name])  # read once: the file holds the drafter's 49152-row embeddings
    fields = gguf_fields(reader)
    arch = fields[gguf.Keys.General.ARCHITECTURE]
    config = json.loads((engine_head(name) / "config.json").read_text())
    assert arch == "dflash" and fields[gguf.Keys.General.FILE_TYPE] == gguf.LlamaFileType.ALL_F32
    assert fields[f"{arch}.target_layers"] == config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert fields[f"{arch}.block_size"] == config["block_size"] == K + 1
    assert fields[f"{arch}.sample_from_anchor"] is False
    assert fields[f"{arch}.has_confidence_head"] is (name == "dspark")
    tensors = {t.name: t for t in reader.tensors}
    assert ({"markov_w1.weight", "markov_w2.weight", "conf_proj.weight"} <= set(tensors)) is (name == "dspark")
    assert not any(n.startswith(("markov_", "conf_proj")) for n in tensors) or name == "dspark"
    d2t = torch.as_tensor(tensors["d2t"].data.copy())
    head = load_file(engine_head(name) / "model.safetensors")
    assert torch.equal(d2t, head["d2t"] + torch.arange(head["d2t"].numel()))  # absolute target ids
    assert tuple(tensors["output.weight"].shape) == (config["hidden_size"], 8192)  # the drafter's own lm_head
