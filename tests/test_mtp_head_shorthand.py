"""`draftsmith eval head=mtp` (issue 48 item 4): the MTP layer the target's own folder ships, evaluated untrained with
no head folder, exactly as head=<that folder> evaluates it; a target that ships none gets one sentence saying how to
train one, before any work."""

from __future__ import annotations

import shutil

import pytest
from helpers import random_layers, two_questions
from safetensors.torch import load_file, save_file

from draftsmith.configs import compose
from draftsmith.core import DraftsmithError
from draftsmith.data_gen.target import TargetConfig, load_target, tiny_tokenizer
from draftsmith.eval import run as ev
from draftsmith.heads import mtp_folders
from draftsmith.heads.mtp import mtp_config_from_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    """(the tiny preset saved as a MiMo folder with a random MTP layer and its tokenizer, the tiny Llama itself)."""
    tiny = load_target(TargetConfig(name="tiny", dtype="float32"))
    folder = mtp_folders.save_as_mimo(tiny.model, tmp_path_factory.mktemp("mtp-head") / "tiny-mimo",
                                      random_layers(mtp_config_from_target(tiny.model.config), seed=3))
    tiny_tokenizer().save_pretrained(folder)
    return folder, tiny.model


def eval_config(target, head, tmp_path, out: str = "out"):
    return compose("eval", [f"target.name={target}", "target.dtype=float32", f"head={head}",
                            f"prompts.path={two_questions(tmp_path)}", "prompts.n=null", "max_new_tokens=12",
                            "repeats=1", "cost_repeats=1", "progress=false", "plot=false", f"out={tmp_path / out}"])


def test_head_mtp_evaluates_the_target_folders_own_layer_as_head_folder_does(mimo, tmp_path):
    folder, _ = mimo
    by_name = ev.run(eval_config(folder, "mtp", tmp_path, "by-name"))
    by_folder = ev.run(eval_config(folder, folder, tmp_path, "by-folder"))
    assert by_name["method"] == "mtp" and by_name["head"] == "mtp" and by_folder["head"] == str(folder)
    assert by_name["drafter"]["path"] == str(folder) and by_name["drafter"]["architecture"] == "MiMoForCausalLM"
    assert by_name["drafter"]["description"] == "the target's own MTP layer"
    for key in ("drafter", "tau", "new_tokens", "accepted_per_position", "proposed_per_position",
                "accepted_length_histogram", "greedy_identical_fraction"):
        assert by_name[key] == by_folder[key], key
    assert sum(by_name["proposed_per_position"]) > 0 and by_name["greedy_identical_fraction"] == 1.0
    # served as the target's own: the target folder is vLLM's model, {"method": "mtp"} with no draft folder
    vllm = by_name["recommendation"]["vllm"]
    assert vllm["command"] == by_folder["recommendation"]["vllm"]["command"]
    assert vllm["command"].startswith(f"vllm serve {folder} --speculative-config ")
    assert vllm["config"] == {"method": "mtp", "num_speculative_tokens": by_name["recommendation"]["k"]}
    assert ev.summary(by_name).startswith(f"eval mtp (the target's own MTP layer) on {folder}: ")
    assert "- head: `mtp` (the target's own MTP layer)" in (tmp_path / "by-name" / "report.md").read_text()


def test_head_mtp_is_the_name_and_a_folder_named_mtp_is_written_with_its_path(mimo, tmp_path, monkeypatch):
    """As `ngram` and `none`: the name always means the target's own layer, whatever the working folder holds."""
    folder, _ = mimo
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mtp").mkdir()  # e.g. a train output named mtp
    assert ev.head_folder(eval_config(folder, "mtp", tmp_path)) == str(folder)
    assert ev.head_folder(eval_config(folder, "./mtp", tmp_path)) == "./mtp"
    assert ev.head_folder(eval_config(folder, "ngram", tmp_path)) is None


def test_a_target_that_ships_no_mtp_layer_gets_one_sentence(mimo, tmp_path):
    _, llama = mimo
    folder = tmp_path / "tiny-llama"
    llama.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    for target, says in ((folder, f"target.name={folder} ships no MTP layer draftsmith reads"),
                         ("tiny", "target.name=tiny names no local folder with a config.json")):
        with pytest.raises(DraftsmithError) as e:
            ev.run(eval_config(target, "mtp", tmp_path))
        assert says in str(e.value) and "`draftsmith train method=mtp target.name=" in str(e.value)
        assert "\n" not in str(e.value) and not (tmp_path / "out").exists()  # refused before any work


def test_a_mimo_without_its_mtp_tensors_is_refused(mimo, tmp_path):
    """config.json declares num_nextn_predict_layers, the weights hold none: head=mtp and head=<folder> alike."""
    folder, _ = mimo
    stripped = tmp_path / "stripped"
    shutil.copytree(folder, stripped)
    tensors = load_file(stripped / "model.safetensors")
    assert any(name.startswith("model.mtp_layers.") for name in tensors)
    save_file({n: t for n, t in tensors.items() if not n.startswith("model.mtp_layers.")},
              stripped / "model.safetensors", metadata={"format": "pt"})
    for head in ("mtp", stripped):
        with pytest.raises(DraftsmithError, match=r"ships no MTP layer: its config\.json declares "
                                                  r"num_nextn_predict_layers 1, but its weights hold no "
                                                  r"model\.mtp_layers\.\* tensor\.$"):
            ev.run(eval_config(stripped, head, tmp_path))
        assert not (tmp_path / "out").exists()
