"""`eval engine=vllm` with an MTP head (issue 48): vLLM serves an MTP layer inside its target ({"method": "mtp"}, no
draft path), so the job's MTP runs must load a folder that holds THIS layer. train's output (the layers alone) is
stitched into a copy of the served target first, as `export format=mimo` writes it; a whole MiMo folder (head=mtp)
is served as it is. Without it vLLM would run the layer the target ships (or, for a Llama, none) while the built-in
decoder measured the trained one. No engine here: the job is captured where it would go to vLLM."""

from __future__ import annotations

import pytest
import torch
from helpers import random_layers
from safetensors.torch import load_file

from draftsmith.configs import compose
from draftsmith.core.engine import Engines
from draftsmith.data_gen.target import TargetConfig, load_target, tiny_tokenizer
from draftsmith.eval import engine_vllm
from draftsmith.eval.run import Drafter
from draftsmith.heads import mtp_folders
from draftsmith.heads.mtp import mtp_config_from_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Captured(Exception):
    pass


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(a tiny Llama target folder, train's output for it: random MTP layers alone, a MiMo folder with others)."""
    tiny = load_target(TargetConfig(name="tiny", dtype="float32"))
    root = tmp_path_factory.mktemp("mtp-engine-model")
    llama = root / "tiny-llama"
    tiny.model.save_pretrained(llama)
    tiny_tokenizer().save_pretrained(llama)
    config = mtp_config_from_target(tiny.model.config)
    trained = mtp_folders.save_mtp(random_layers(config, seed=5), root / "trained")
    mimo = mtp_folders.save_as_mimo(tiny.model, root / "tiny-mimo", random_layers(config, seed=6))
    return llama, trained, mimo


MTP_ENGINES = Engines(vllm="mtp", in_target=True)  # the mtp row's (commands/methods.py)


def captured_job(monkeypatch, head, target_folder, out, engines=MTP_ENGINES) -> dict:
    """The job engine_report would hand to vLLM for `head` on `target_folder`."""
    jobs = []

    def run_job(job, **kw):
        jobs.append(job)
        raise Captured

    monkeypatch.setattr(engine_vllm, "served_target", lambda target: str(target_folder))
    monkeypatch.setattr(engine_vllm.engine, "run_job", run_job)
    cfg = compose("eval", ["target.name=tiny", "engine=vllm", "temperature=0", "baselines=[ngram]",
                           "sweep_k=[2]", f"out={out}"])
    target = type("T", (), {"eos_token_ids": [0], "model": type("M", (), {"dtype": torch.float32})()})()
    setup = type("S", (), {"cfg": cfg, "drafting": cfg.drafting, "target": target})()
    architecture = mtp_folders.read_config_json(head)["architectures"][0]  # as eval's load_drafter records it
    drafter = Drafter(engines.vllm, lambda: None, {"path": str(head), "architecture": architecture}, None, engines)
    sample = type("Sample", (), {"prompt_ids": [5, 6], "tokens": [1, 2]})()
    with pytest.raises(Captured):
        engine_vllm.engine_report(setup, drafter, {engine_vllm.TARGET_ONLY: [sample]}, {}, "org/target")
    return jobs[0]


def models(job) -> dict:
    return {run["name"]: run.get("model") for run in job["runs"]}


def test_trained_layers_are_stitched_into_the_served_target_for_the_mtp_runs(folders, monkeypatch, tmp_path):
    llama, trained, _ = folders
    job = captured_job(monkeypatch, trained, llama, tmp_path / "eval")
    stitched = tmp_path / "eval" / "engine_model"
    # every MTP run (K and the sweep's K) loads the stitched folder; target-only and n-gram load the target
    assert models(job) == {engine_vllm.TARGET_ONLY: None, "mtp": str(stitched), "mtp@K=2": str(stitched),
                           "ngram": None}
    assert job["target"] == str(llama)
    assert mtp_folders.read_config_json(stitched)["architectures"] == [mtp_folders.MIMO_ARCHITECTURE]
    served = load_file(str(stitched / "model.safetensors"))
    head = load_file(str(trained / "model.safetensors"))
    target = load_file(str(llama / "model.safetensors"))
    assert head and all(torch.equal(served[name], t) for name, t in head.items())  # the layer eval measured
    assert all(torch.equal(served[name], t) for name, t in target.items())  # the target as it is
    assert served["model.mtp_layers.0.input_proj.weight"].dtype == torch.float32  # the job's dtype


def test_a_whole_mimo_folder_is_served_as_it_is(folders, monkeypatch, tmp_path):
    _, _, mimo = folders
    job = captured_job(monkeypatch, mimo, mimo, tmp_path / "eval")
    assert models(job)["mtp"] == str(mimo) and models(job)["ngram"] is None
    assert not (tmp_path / "eval" / "engine_model").exists()


def test_a_head_served_beside_the_target_gets_no_model(folders, monkeypatch, tmp_path):
    """Negative control: a method with a draft folder (EAGLE-3's row) leaves every run on the target."""
    llama, trained, _ = folders
    job = captured_job(monkeypatch, trained, llama, tmp_path / "eval", Engines(vllm="eagle3"))
    assert set(models(job).values()) == {None} and len(job["runs"]) == 4
    assert not (tmp_path / "eval" / "engine_model").exists()


def test_sglang_serves_the_mtp_folder_as_model_and_draft_and_other_heads_beside_the_target():
    """SGLang loads a MiMo's MTP layer as a draft model of the same folder (NEXTN, its EAGLE worker): MiMo is not among
    the architectures whose draft path SGLang fills in itself, so both paths are given. Not engine-checked."""
    from draftsmith.core.methods import methods
    from draftsmith.eval.cost import serving_settings

    mtp = serving_settings("mtp", methods()["mtp"].engines, "org/target", "/runs/mimo", 3)["sglang"]
    assert mtp["command"] == ("python -m sglang.launch_server --model-path /runs/mimo --speculative-algorithm NEXTN "
                              "--speculative-draft-model-path /runs/mimo --speculative-num-steps 3 "
                              "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4")
    eagle3 = serving_settings("eagle3", methods()["eagle3"].engines, "org/target", "/runs/e3", 3)["sglang"]
    assert eagle3["command"].startswith("python -m sglang.launch_server --model-path org/target ")


def test_the_serving_commands_of_trained_layers_name_the_folder_export_stitches(folders, tmp_path):
    """train's MTP output is not servable as it is: the recommendation names `<head>-mimo` and the export command
    that writes it (report.md and the summary print it first); a whole MiMo folder is named as it is."""
    from draftsmith.eval.engine_vllm import served_head, with_export_command
    from draftsmith.core.methods import methods
    from draftsmith.eval.cost import serving_settings

    engines = methods()["mtp"].engines

    _, trained, mimo = folders
    layers = Drafter("mtp", None, {"path": str(trained), "architecture": mtp_folders.MTP_ARCHITECTURE}, None,
                     engines)
    served, export = served_head(layers)
    assert served == f"{trained}-mimo"
    assert export == f"draftsmith export head={trained} format=mimo out={trained}-mimo"
    settings = with_export_command(serving_settings("mtp", engines, "org/target", served, 3), export)
    assert settings["vllm"]["command"].startswith(f"vllm serve {trained}-mimo ")
    assert settings["vllm"]["export_command"] == settings["sglang"]["export_command"] == export
    whole = Drafter("mtp", None, {"path": str(mimo), "architecture": mtp_folders.MIMO_ARCHITECTURE}, None, engines)
    assert served_head(whole) == (str(mimo), None)
