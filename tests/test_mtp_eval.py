"""`draftsmith eval` of the MTP layer a checkpoint ships, untrained (issue 48): head=<the MiMo folder> is read by the
mtp row, drafts with the layer from the folder's own safetensors, and stays lossless (greedy token-identical)."""

from __future__ import annotations


import pytest
from helpers import random_layers, two_questions

from draftsmith.configs import compose
from draftsmith.data_gen.target import TargetConfig, load_target, tiny_tokenizer
from draftsmith.eval import run as ev
from draftsmith.heads import mtp_folders
from draftsmith.heads.mtp import mtp_config_from_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_eval_reads_the_mtp_layer_a_mimo_folder_ships(tmp_path):
    tiny = load_target(TargetConfig(name="tiny", dtype="float32"))
    folder = mtp_folders.save_as_mimo(tiny.model, tmp_path / "tiny-mimo",
                                      random_layers(mtp_config_from_target(tiny.model.config), seed=3))
    tiny_tokenizer().save_pretrained(folder)
    report = ev.run(compose("eval", [f"target.name={folder}", "target.dtype=float32", f"head={folder}",
                                     f"prompts.path={two_questions(tmp_path)}", "prompts.n=null", "max_new_tokens=12",
                                     "repeats=1", "progress=false", "plot=false", f"out={tmp_path / 'eval'}"]))
    assert report["method"] == "mtp" and report["drafter"]["architecture"] == "MiMoForCausalLM"
    assert report["greedy_identical_fraction"] == 1.0
    assert report["tau"] >= 1.0 and sum(report["proposed_per_position"]) > 0
