"""The eval stage end to end on the tiny target: report keys and consistency, files, refusals."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from helpers import SPEC_BENCH, eval_cfg, save_tiny_head

from draftsmith.core import DraftsmithError
from draftsmith.cli import main
from draftsmith.configs import check_config, compose
from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.eval.run import run

REPORT_KEYS = {
    "method", "target", "head", "temperature", "top_k", "top_p", "drafting", "n_prompts", "new_tokens", "tau",
    "per_position_acceptance", "target_only_tokens_per_s", "speculative_tokens_per_s", "speedup",
    "per_category", "software", "hardware", "conventions", "baselines", "accepted_length_histogram",
}


def check_report(report, out):
    assert REPORT_KEYS <= set(report)
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["tau"] == pytest.approx(report["tau"])
    assert report["tau"] >= 1.0
    assert report["speedup"] == pytest.approx(report["speculative_tokens_per_s"] / report["target_only_tokens_per_s"])
    assert set(report["per_category"]) == {"writing", "math"}
    assert sum(c["n"] for c in report["per_category"].values()) == report["n_samples"]
    for c in report["per_category"].values():
        assert c["speedup"] == pytest.approx(c["speculative_tokens_per_s"] / c["target_only_tokens_per_s"])
    assert {"torch", "transformers", "draftsmith", "python"} <= set(report["software"])
    assert {"cpu", "cpu_cores", "device"} <= set(report["hardware"])
    assert "bonus token included" in report["conventions"]
    hist = report["accepted_length_histogram"]  # {tokens emitted by a verification: verifications}
    assert sum(int(n) * c for n, c in hist.items()) == pytest.approx(report["tau"] * sum(hist.values()))
    assert on_disk["accepted_length_histogram"] == hist
    md = (out / "report.md").read_text()
    assert "| writing |" in md and "bonus token included" in md
    assert "| verifications | " + " | ".join(str(c) for c in hist.values()) + " |" in md
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "config.yaml").is_file() and (out / "manifest.json").is_file()


def test_ngram_chain_report(questions, tmp_path):
    cfg = eval_cfg(questions, tmp_path, "head=ngram", "prompts.multi_turn=true", "baselines=[hf_generate]", "repeats=2")
    report = run(cfg)
    check_report(report, tmp_path)
    assert report["n_prompts"] == 4 and report["n_samples"] == 5  # one prompt has two turns
    assert report["greedy_identical_fraction"] == 1.0  # lossless: same tokens as target-only
    assert "hf_generate" in report["baselines"]


def test_eagle3_chain_and_tree(questions, tmp_path):
    head = save_tiny_head(tmp_path / "head")
    report = run(eval_cfg(questions, tmp_path / "chain", f"head={head}", "baselines=[ngram]",
                          "drafting.num_speculative_tokens=5"))
    check_report(report, tmp_path / "chain")
    assert report["method"] == "eagle3" and "ngram" in report["baselines"]
    acc = report["per_position_acceptance"]
    assert len(acc) == 5 and all(a >= b for a, b in zip(acc, acc[1:]))  # chain: monotone non-increasing
    assert report["greedy_identical_fraction"] == 1.0
    tree = run(eval_cfg(questions, tmp_path / "tree", f"head={head}", "drafting.mode=tree",
                        "drafting.tree_top_k=2", "drafting.tree_budget=8", "drafting.num_speculative_tokens=3"))
    check_report(tree, tmp_path / "tree")
    assert tree["drafting"]["mode"] == "tree" and tree["greedy_identical_fraction"] == 1.0


def test_sampling_report(questions, tmp_path):
    report = run(eval_cfg(questions, tmp_path, "head=ngram", "temperature=1.0", "top_k=20", "repeats=1"))
    check_report(report, tmp_path)
    assert report["greedy_identical_fraction"] is None and report["top_k"] == 20


def test_head_for_another_target_is_refused(questions, tmp_path):
    identity = load_target(TargetConfig(name="tiny", dtype="float32")).identity()
    head = save_tiny_head(tmp_path / "head", {**identity, "target_id": "other", "target_hash": "0123456789abcdef"})
    with pytest.raises(DraftsmithError) as e:
        run(eval_cfg(questions, tmp_path / "out", f"head={head}"))
    assert "other" in str(e.value) and "\n" not in str(e.value)


def test_run_takes_a_dictconfig_once_checked(questions, tmp_path):
    """A DictConfig (OmegaConf.structured, Hydra's own) goes through check_config once, as the CLI does, and run takes
    the typed tree: the stage's own check answers (head= names no folder, found after the target is loaded), not a
    TypeError."""
    cfg = OmegaConf.structured(eval_cfg(questions, tmp_path / "out", f"head={tmp_path / 'nohead'}"))
    with pytest.raises(DraftsmithError, match="is neither `ngram`, `none`, `mtp` nor a folder"):
        run(check_config("eval", cfg))


def test_unknown_head_is_refused(questions, tmp_path):
    with pytest.raises(DraftsmithError, match="head="):
        run(eval_cfg(questions, tmp_path, "head=no/such/folder"))


def test_folder_only_another_tool_reads_is_refused(questions, tmp_path):
    """A speculators-format folder: the EAGLE-3 method names it foreign (draftsmith.core.methods), eval refuses it."""
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "config.json").write_text(json.dumps({"architectures": ["Eagle3DraftModel"]}))
    with pytest.raises(DraftsmithError, match="speculators format") as e:
        run(eval_cfg(questions, tmp_path / "out", f"head={tmp_path / 'spec'}"))
    assert "\n" not in str(e.value)


def test_hf_assisted_needs_a_transformers_drafter(questions, tmp_path):
    head = save_tiny_head(tmp_path / "head")
    with pytest.raises(DraftsmithError, match="hf_assisted"):
        run(eval_cfg(questions, tmp_path / "out", f"head={head}", "baselines=[hf_assisted]"))


def test_cli_prints_the_summary_run_returns(questions, tmp_path, capsys):
    main(["eval", "target=tiny", "head=ngram", f"prompts.path={questions}", "prompts.n=1", "max_new_tokens=6",
          "repeats=1", "warmup_prompts=0", "progress=false", "plot=false", f"out={tmp_path}"])
    out = capsys.readouterr().out
    assert "tau" in out and "speedup" in out and str(tmp_path / "report.md") in out


@pytest.mark.parametrize("override", [
    "drafting.num_speculative_tokens=0", "drafting.num_speculative_tokens=1000", "drafting.mode=star",
    "drafting.tree_budget=0", "temperature=-1", "top_p=0", "baselines=[magic]", "repeats=0",
])
def test_cli_out_of_range_settings_exit_2(questions, tmp_path, capsys, override):
    mode = ["drafting.mode=tree"] if "tree_budget" in override else []
    with pytest.raises(SystemExit) as e:
        main(["eval", "target=tiny", "head=ngram", f"prompts.path={questions}", f"out={tmp_path}", *mode, override])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("draftsmith eval: error:") and len(err.splitlines()) == 1
    assert override.split("=")[0] in err


@pytest.mark.slow
def test_smollm2_spec_bench_ngram(tmp_path):
    """The embedded SmolLM2 on two Spec-Bench MT-bench questions (both turns): lossless, consistent figures."""
    cfg = compose("eval", ["target=smollm2", "target.dtype=float32", "head=ngram", f"prompts.path={SPEC_BENCH}",
                           "prompts.categories=[writing]", "prompts.n=2", "prompts.multi_turn=true",
                           "max_new_tokens=32", "repeats=1", "progress=false", f"out={tmp_path}"])
    report = run(cfg)
    assert report["n_prompts"] == 2 and report["n_samples"] == 4
    assert report["greedy_identical_fraction"] == 1.0 and report["tau"] >= 1.0
    assert report["speedup"] == pytest.approx(report["speculative_tokens_per_s"] / report["target_only_tokens_per_s"])


def test_draft_model_head_with_hf_assisted_baseline(questions, tmp_path):
    from transformers import LlamaForCausalLM

    from draftsmith.data_gen.target import tiny_model_config

    target = load_target(TargetConfig(name="tiny", dtype="float32"))
    torch.manual_seed(1)
    draft = LlamaForCausalLM(tiny_model_config(target.vocab_size, num_layers=2))
    draft.config.eos_token_id = target.model.config.eos_token_id
    draft.config.pad_token_id = target.model.config.pad_token_id
    draft.save_pretrained(tmp_path / "draft")
    report = run(eval_cfg(questions, tmp_path / "out", f"head={tmp_path / 'draft'}", "baselines=[hf_assisted]",
                          "prompts.n=2"))
    assert report["method"] == "draft" and report["greedy_identical_fraction"] == 1.0
    assert report["baselines"]["hf_assisted"]["tokens_per_s"] > 0
