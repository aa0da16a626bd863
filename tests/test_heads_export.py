"""`draftsmith export`: both formats through the real CLI, the speculators names and config."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from helpers import EAGLE3_HEAD_TENSORS, logits_of, random_head, random_inputs

from draftsmith.cli import main
from draftsmith.export import ExportConfig, default_verifier, run
from draftsmith.heads.eagle3_folders import load_eagle3, save_eagle3
from draftsmith.heads.eagle3_folders import speculators_name


@pytest.fixture
def head_folder(tiny_target, tmp_path):
    return save_eagle3(random_head(tiny_target), tmp_path / "trained", manifest_target=tiny_target.identity())


def tensors_of(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_cli_export_speculators(head_folder, tmp_path, tiny_target, capsys):
    out = tmp_path / "spec"
    main(["export", f"head={head_folder}", "format=speculators", f"out={out}", "num_speculative_tokens=5"])
    assert f"to {out}" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DraftModel"]
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == 100
    assert config["eagle_aux_hidden_state_layer_ids"] == tiny_target.aux_layer_ids
    assert config["norm_before_residual"] is False and config["norm_before_fc"] is False
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["vocab_size"] == tiny_target.vocab_size and layer["head_dim"] == 16
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 5,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert spec["verifier"]["name_or_path"] == "tiny"  # the manifest's target id by default
    assert config["speculators_version"]

    tensors = tensors_of(out)
    assert set(tensors) == {speculators_name(n) for n in EAGLE3_HEAD_TENSORS} | {"embed_tokens.weight"}
    assert "layers.0.self_attn.q_proj.weight" in tensors and not any(n.startswith("midlayer") for n in tensors)
    assert tensors["layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16  # export default
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert (out / "manifest.json").is_file()


def test_cli_export_eagle3_in_bf16_loads_back(head_folder, tmp_path):
    out = tmp_path / "e3"
    main(["export", f"head={head_folder}", f"out={out}", "include_embeddings=false"])
    tensors = tensors_of(out)
    assert set(tensors) == EAGLE3_HEAD_TENSORS
    assert tensors["fc.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["produced_by"]["stage"] == "export"
    original = load_eagle3(head_folder)
    exported = load_eagle3(out, target_embeddings=original.embed_tokens, dtype=torch.float32)
    inputs = random_inputs(original)
    torch.testing.assert_close(logits_of(exported, *inputs), logits_of(original, *inputs), atol=0.1, rtol=0.05)


def test_run_with_a_plain_dataclass_returns_the_path(head_folder, tmp_path):
    out = run(ExportConfig(head=str(head_folder), out=str(tmp_path / "x"), dtype="float32"))
    assert out == tmp_path / "x"
    assert torch.equal(tensors_of(out)["fc.weight"], tensors_of(head_folder)["fc.weight"])


def test_default_out_is_beside_the_head(head_folder):
    out = run(ExportConfig(head=f"{head_folder}/", format="speculators"))
    assert out == head_folder.with_name("trained-speculators") and (out / "config.json").is_file()


@pytest.mark.parametrize("overrides, words", [
    (["head=/no/such/head"], "/no/such/head does not exist"),
    ([], "head= is required"),  # refused when the config is built
    (["head={head}", "format=onnx"], "format=onnx is not one of eagle3, speculators"),
    (["head={head}", "out={head}/inside"], "is inside the head folder"),
])
def test_cli_errors_are_one_sentence_and_exit_2(head_folder, tmp_path, capsys, overrides, words):
    out = tmp_path / "o"
    args = [o.format(head=head_folder) for o in overrides]
    args += [] if any(a.startswith("out=") for a in args) else [f"out={out}"]
    with pytest.raises(SystemExit) as e:
        main(["export", *args])
    assert sorted(p.name for p in head_folder.iterdir() if not p.name.startswith(".")) == [
        "config.json", "manifest.json", "model.safetensors"]  # (and draftsmith's hidden record of them)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_speculators_verifier_of_a_preset_target_is_one_vllm_can_load(caplog):
    # vLLM serves a speculators folder as the model and loads the verifier by name: "smollm2" would not load
    def warned() -> str:  # the stage's warnings go to logging (the CLI shows them), not print
        text = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
        caplog.clear()
        return text

    assert default_verifier("smollm2") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "not the dequantised GGUF" in warned()
    assert default_verifier("tiny") == "tiny" and "vLLM cannot load" in warned()
    assert default_verifier("/models/llama") == "/models/llama" and warned() == ""
