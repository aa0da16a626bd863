"""The demo end to end on the tiny flavour (data-gen -> EAGLE-3 training -> eval), and its skips."""

import json

import pytest

from draftsmith.cli import main
from draftsmith.configs import compose
from draftsmith.demo import FLAVOURS, run, sizes, summary


@pytest.mark.timeout(180)
def test_tiny_demo_end_to_end_then_skipped(tmp_path):
    cfg = compose("demo", ["flavour=tiny", f"out={tmp_path}", "progress=false"])
    result = run(cfg)
    for stage in ("data_gen", "train", "eval"):
        assert (tmp_path / f"{stage}.done.json").is_file()
    assert (tmp_path / "head" / "final" / "model.safetensors").is_file()
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["method"] == "eagle3" and report["temperature"] == 0.0
    assert report["n_prompts"] == FLAVOURS["tiny"]["eval_prompts"]
    assert report["tau"] >= 1.0 and "ngram" in report["baselines"]
    assert (tmp_path / "eval" / "report.md").is_file() and (tmp_path / "eval" / "report.png").is_file()
    lines = summary(result)  # what the CLI prints after run()
    assert "tau" in lines and "speedup" in lines and "per-position acceptance" in lines
    # a second run finds every stage complete with the same settings
    again = run(cfg)
    assert again["skipped"] == ["data_gen", "train", "eval"]
    assert again["report"]["tau"] == result["report"]["tau"]
    # changing the eval knob reruns eval only
    third = run(compose("demo", ["flavour=tiny", f"out={tmp_path}", "progress=false", "eval_max_new_tokens=6"]))
    assert third["skipped"] == ["data_gen", "train"]
    # changing a training knob retrains and re-evaluates
    fourth = run(compose("demo", ["flavour=tiny", f"out={tmp_path}", "progress=false", "eval_max_new_tokens=6",
                                  "train_steps=2"]))
    assert fourth["skipped"] == ["data_gen"] and set(fourth["seconds"]) == {"train", "eval", "total"}


def test_sizes_take_explicit_knobs():
    cfg = compose("demo", ["train_steps=7"])
    s = sizes(cfg)
    assert s["train_steps"] == 7 and s["n_prompts"] == FLAVOURS["smollm2"]["n_prompts"]


def test_bad_flavour_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "flavour=huge"])
    assert e.value.code == 2
    assert "flavour" in capsys.readouterr().err
