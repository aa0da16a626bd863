"""The demo end to end on the tiny flavour (data-gen -> EAGLE-3 training -> eval), and its skips."""

import json

import pytest

from draftsmith.cli import main
from draftsmith.configs import compose
from draftsmith.demo import (MAX_EPOCHS, MIN_PROMPTS, FLAVOURS, Rates, measured_rates, plan_sizes, plan_text,
                             resize_training, resized_text, run, sizes, summary)


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
    assert report["tau"] >= 1.0 and {"ngram", "ngram+eagle3"} <= set(report["baselines"])
    assert (tmp_path / "eval" / "report.md").is_file() and (tmp_path / "eval" / "report.png").is_file()
    lines = summary(result)  # what the CLI prints after run()
    assert "tau" in lines and "speedup" in lines and "per-position acceptance" in lines
    assert "built-in decoder, side by side: eagle3 tau" in lines and "ngram+eagle3 tau" in lines
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


# ---------------------------------------------------------------------------------------------
# Sizing to the budget (pure function, rates injected), and the calibration run on the tiny target.

RATES = Rates(load_s=5.0, data_gen_s_per_sample=1.0, train_step_s=0.5, train_fixed_s=20.0, eval_fixed_s=30.0,
              eval_s_per_token=0.1)


def test_plan_fits_the_budget_and_keeps_the_epochs():
    s = sizes(compose("demo", []))
    plan = plan_sizes(s, budget_s=1200.0, spent_s=60.0, rates=RATES)
    epochs = FLAVOURS["smollm2"]["train_steps"] / FLAVOURS["smollm2"]["n_prompts"]
    assert plan["train_steps"] == round(epochs * plan["n_prompts"])
    # the estimate adds up what the rates say each stage costs, and stays inside the budget minus the margin
    e = plan["estimate_s"]
    eval_s = 30.0 + 0.1 * s["eval_prompts"] * s["eval_max_new_tokens"]
    assert e["eval"] == pytest.approx(eval_s, abs=0.1)
    assert e["data_gen"] == pytest.approx(5.0 + 1.0 * (plan["n_prompts"] + s["eval_prompts"]), abs=0.1)
    assert e["train"] == pytest.approx(20.0 + 0.5 * plan["train_steps"], abs=0.1)
    assert e["total"] == pytest.approx(60.0 + e["data_gen"] + e["train"] + eval_s, abs=0.5)
    assert plan["fits"] and e["total"] <= 1200.0 * (1 - 0.08) + 2.0  # one more prompt would not fit
    more = plan_sizes(s, 1200.0, 60.0, Rates(**{**vars(RATES), "train_step_s": 0.25}))
    assert more["n_prompts"] > plan["n_prompts"]  # a faster machine gets more data
    slower = plan_sizes(s, 1200.0, 60.0, Rates(**{**vars(RATES), "data_gen_s_per_sample": 3.0}))
    assert slower["n_prompts"] < plan["n_prompts"]
    assert "training prompts" in plan_text(plan) and "s/sample" in plan_text(plan)



def test_training_is_resized_to_the_time_data_gen_left():
    s = sizes(compose("demo", []))
    plan = plan_sizes(s, budget_s=1200.0, spent_s=60.0, rates=RATES)
    e = plan["estimate_s"]
    on_time = resize_training(plan, 1200.0, elapsed_s=e["spent"] + e["data_gen"])
    assert abs(on_time["train_steps"] - plan["train_steps"]) <= 2  # data-gen as estimated: the plan's steps
    early = resize_training(plan, 1200.0, elapsed_s=e["spent"] + e["data_gen"] - 100.0)
    assert early["train_steps"] == on_time["train_steps"] + 200  # 100 s more at 0.5 s a step
    assert early["fits"] and early["estimate_s"]["total"] <= 1200.0 * (1 - 0.08) + 0.5
    late = resize_training(plan, 1200.0, elapsed_s=e["spent"] + e["data_gen"] + 100.0)
    assert late["train_steps"] == on_time["train_steps"] - 200 and late["fits"]
    n = plan["n_prompts"]
    assert resize_training(plan, 1200.0, elapsed_s=1150.0)["train_steps"] == n  # never under one epoch...
    assert not resize_training(plan, 1200.0, elapsed_s=1150.0)["fits"]  # ...and then it says it overruns
    assert resize_training(plan, 1e5, elapsed_s=10.0)["train_steps"] == MAX_EPOCHS * n  # nor over MAX_EPOCHS
    again = dict(plan, **late)  # a second re-size still names the first plan's steps
    assert resize_training(again, 1200.0, 900.0)["resized"]["planned_steps"] == plan["train_steps"]
    text = resized_text(dict(plan, **late))
    assert f"from {plan['train_steps']} to {late['train_steps']} steps" in text and "over the" not in text
    assert "over the 20-minute budget" in resized_text(dict(plan, **resize_training(plan, 1200.0, 1150.0)))


def test_plan_that_cannot_fit_says_so():
    s = sizes(compose("demo", []))
    plan = plan_sizes(s, budget_s=120.0, spent_s=100.0, rates=RATES)
    assert plan["n_prompts"] == MIN_PROMPTS and not plan["fits"]
    assert "overrun" in plan_text(plan)


def test_budget_applies_only_to_the_budgeted_flavour_and_unfixed_sizes():
    assert sizes(compose("demo", []))["budget"] is True
    assert sizes(compose("demo", ["budget_min=null"]))["budget"] is False
    assert sizes(compose("demo", ["n_prompts=100"]))["budget"] is False
    assert sizes(compose("demo", ["flavour=smollm2-fixed"]))["budget"] is False
    fixed = sizes(compose("demo", ["flavour=smollm2-fixed"]))
    assert (fixed["n_prompts"], fixed["train_steps"]) == (480, 960)


def test_rates_from_a_calibration_run(tmp_path):
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": i + 1, "step_s": t}) for i, t in enumerate([3.0, 0.5, 0.4, 0.6])) + "\n")
    report = {"target_only_tokens_per_s": 10.0, "speculative_tokens_per_s": 20.0,
              "baselines": {"ngram": {"tokens_per_s": 10.0}}}
    calib = {"seconds": {"data_gen": 37.0, "train": 10.0, "eval": 20.0}, "report": report}
    cs = {"n_prompts": 32, "eval_prompts": 1, "eval_max_new_tokens": 32, "repeats": 1}
    r = measured_rates(calib, tmp_path, cs, load_s=4.0)
    # llama.cpp's decoders count per token too: target-only and each drafter run
    with_llamacpp = dict(report, llamacpp={"target_only_tokens_per_s": 50.0,
                                           "runs": {"eagle3": {"speculative_tokens_per_s": 25.0}}})
    r2 = measured_rates(dict(calib, report=with_llamacpp), tmp_path, cs, load_s=4.0)
    assert r2.eval_s_per_token == pytest.approx(0.1 + 0.05 + 0.1 + 0.02 + 0.04)
    assert r2.eval_fixed_s == pytest.approx(20.0 - 0.31 * 32)
    assert r.data_gen_s_per_sample == pytest.approx(33.0 / 33)
    assert r.train_step_s == pytest.approx(0.5)  # mean of the steps after the first
    assert r.train_fixed_s == pytest.approx(10.0 - 4.5)
    assert r.eval_s_per_token == pytest.approx(0.1 + 0.05 + 0.1)
    assert r.eval_fixed_s == pytest.approx(20.0 - 0.25 * 32)


def test_a_load_timed_longer_than_data_gen_keeps_a_positive_rate(tmp_path):
    """The load is timed apart from the stage: where it took longer than a tiny data-gen (a busy machine), the
    whole stage counts as samples instead of a rate of 0 (seen in CI under pytest-xdist)."""
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "metrics.jsonl").write_text(json.dumps({"step": 1, "step_s": 0.5}) + "\n")
    report = {"target_only_tokens_per_s": 10.0, "speculative_tokens_per_s": 20.0}
    calib = {"seconds": {"data_gen": 3.3, "train": 10.0, "eval": 20.0}, "report": report}
    cs = {"n_prompts": 32, "eval_prompts": 1, "eval_max_new_tokens": 32, "repeats": 1}
    assert measured_rates(calib, tmp_path, cs, load_s=4.0).data_gen_s_per_sample == pytest.approx(3.3 / 33)


@pytest.mark.timeout(300)
def test_budgeted_tiny_demo_calibrates_plans_and_reuses_its_plan(tmp_path, monkeypatch):
    monkeypatch.setitem(FLAVOURS, "tiny", dict(FLAVOURS["tiny"], budget=True))
    # 0.001 min = 60 ms: less than the calibration itself takes on any machine, so the plan can never fit
    # (0.05 min fitted on an idle fast machine and the test failed there).
    cfg = compose("demo", ["flavour=tiny", f"out={tmp_path}", "progress=false", "budget_min=0.001"])
    result = run(cfg)
    plan = json.loads((tmp_path / "plan.json").read_text())["plan"]
    assert result["plan"]["n_prompts"] == plan["n_prompts"] == MIN_PROMPTS  # 60 ms cannot hold more
    assert not plan["fits"] and plan["rates"]["train_step_s"] > 0 and plan["rates"]["data_gen_s_per_sample"] > 0
    assert (tmp_path / "calibration" / "eval" / "report.json").is_file()
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["counts"]["prompts"] == MIN_PROMPTS + FLAVOURS["tiny"]["eval_prompts"]
    assert result["train"]["steps"] == plan["train_steps"]
    # re-sized after data-gen: 60 ms left nothing, so the least the plan trains (its own steps, under one epoch here)
    assert plan["resized"]["planned_steps"] == plan["train_steps"] and not plan["fits"]
    again = run(cfg)  # the saved plan is reused: same sizes, so every stage is complete
    assert again["plan"]["n_prompts"] == plan["n_prompts"] and again["skipped"] == ["data_gen", "train", "eval"]


def test_smollm2_demo_measures_in_llamacpp_only_where_it_is_built(monkeypatch):
    from draftsmith import demo

    monkeypatch.setattr(demo.llamacpp, "llamacpp_missing", lambda: None)
    assert demo.llamacpp_overrides({"target": "smollm2"}) == ["engine=llamacpp", "llamacpp_target=same"]
    assert demo.llamacpp_overrides({"target": "tiny"}) == []  # no GGUF of its own: nothing a CPU user serves
    monkeypatch.setattr(demo.llamacpp, "llamacpp_missing", lambda: "llama.cpp not built: x does not exist")
    assert demo.llamacpp_overrides({"target": "smollm2"}) == []
    line = demo.llamacpp_summary({}, "smollm2")[0]
    assert "not built" in line and demo.llamacpp.BUILD in line


def test_demo_measures_the_gguf_types_it_is_given_side_by_side(monkeypatch, tmp_path):
    """gguf_outtypes reaches the demo's eval (each type a head run and a head + n-gram run); unset, eval's default
    (export's type); a wrong list is refused in one sentence before any work."""
    from draftsmith import demo
    from draftsmith.core import DraftsmithError

    monkeypatch.setattr(demo.llamacpp, "llamacpp_missing", lambda: None)
    cfg = compose("demo", [f"out={tmp_path}", "gguf_outtypes=[f32,q8_0]"])
    overrides = demo.stage_overrides(cfg, sizes(cfg), tmp_path)["eval"]
    assert overrides[-3:] == ["engine=llamacpp", "llamacpp_target=same", "gguf_outtypes=[f32,q8_0]"]
    assert compose("eval", overrides).gguf_outtypes == ["f32", "q8_0"]
    default = compose("demo", [f"out={tmp_path}"])
    assert not any(o.startswith("gguf_outtypes") for o in demo.stage_overrides(default, sizes(default), tmp_path)["eval"])
    with pytest.raises(DraftsmithError) as e:
        compose("demo", ["gguf_outtypes=[f32,f32]"])
    assert "gguf_outtypes" in str(e.value) and "\n" not in str(e.value)


def test_demo_summary_names_llamacpps_winner():
    """The winner is the one eval's llama.cpp section names (`fastest`); a report written before eval named it
    (a rerun that skips eval reads its earlier report.json) gets the same rule, the highest speedup."""
    from draftsmith import demo

    def report(head, ngram, mixed, fastest=None):
        runs = {"eagle3": {"speedup": head, "tau": 1.9}, "ngram": {"speedup": ngram, "tau": 3.0},
                "ngram+eagle3": {"speedup": mixed, "tau": 2.1}}
        section = {"runs": runs, "tau": 1.9, "target": "/x/SmolLM2.Q4_1.gguf", "target_only_tokens_per_s": 30.0}
        return {"llamacpp": section | ({"fastest": fastest} if fastest else {})}

    # ": <name> wins": "eagle3 wins" alone is also in "ngram+eagle3 wins"
    line = demo.llamacpp_summary(report(1.01, 1.12, 1.15, fastest="ngram+eagle3"), "smollm2")[0]
    assert ": ngram+eagle3 wins" in line and "eagle3 1.01x" in line and "ngram 1.12x" in line
    assert ": eagle3 wins" in demo.llamacpp_summary(report(1.3, 1.12, 1.15, fastest="eagle3"), "smollm2")[0]
    slow = demo.llamacpp_summary(report(0.8, 0.9, 0.95, fastest="ngram+eagle3"), "smollm2")[0]
    assert "none is faster than target-only; ngram+eagle3 is the least slow" in slow
    # the report's word, not a rule of the demo's own: a section naming ngram is read as naming ngram
    assert ": ngram wins" in demo.llamacpp_summary(report(1.3, 1.12, 1.15, fastest="ngram"), "smollm2")[0]
    # a report from before `fastest`: the highest speedup, as eval's rule
    assert ": eagle3 wins" in demo.llamacpp_summary(report(1.3, 1.12, 1.15), "smollm2")[0]
    assert ": ngram+eagle3 wins" in demo.llamacpp_summary(report(1.01, 1.12, 1.15), "smollm2")[0]


def test_demo_summary_puts_the_builtin_drafters_side_by_side_and_names_the_winner():
    from draftsmith import demo

    def report(mixed, head, ngram):
        return {"method": "ngram+eagle3", "tau": 1.6, "speedup": mixed,
                "baselines": {"eagle3": {"tau": 1.3, "speedup": head}, "ngram": {"tau": 1.4, "speedup": ngram},
                              "hf_generate": {"tau": None, "speedup": 0.5}}}

    line = demo.builtin_summary(report(1.2, 1.05, 1.1))[0]
    assert "ngram+eagle3 tau 1.60 1.20x" in line and "eagle3 tau 1.30 1.05x" in line and "ngram tau 1.40 1.10x" in line
    assert line.endswith("ngram+eagle3 wins") and "hf_generate" not in line  # not a drafter
    assert demo.builtin_summary(report(1.2, 1.05, 1.3))[0].endswith("ngram wins")
    assert demo.builtin_summary(report(0.8, 0.7, 0.9))[0].endswith("none is faster than target-only; ngram is the "
                                                                   "least slow")
    assert demo.builtin_summary({"method": "eagle3", "tau": 1.3, "speedup": 1.0, "baselines": {}}) == []


def test_ngram_plus_head_baseline_needs_a_head_folder_and_no_ngram_first():
    from draftsmith.core import DraftsmithError

    cfg = compose("eval", ["head=runs/train/final", "baselines=[ngram,ngram+head]"])
    assert list(cfg.baselines) == ["ngram", "ngram+head"]
    for bad in (["head=runs/train/final", "ngram_first=true"], ["head=ngram"]):
        with pytest.raises(DraftsmithError) as e:
            compose("eval", bad + ["baselines=[ngram+head]"])
        assert "ngram+head" in str(e.value) and "\n" not in str(e.value)
