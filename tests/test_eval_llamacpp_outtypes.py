"""`eval engine=llamacpp gguf_outtypes=[...]`: every head GGUF type measured side by side in one run (issue 47 item 5).

No engine here: the run plan is read as built (eval/engine_llamacpp.py `llamacpp_runs`), and the report from a
llama.cpp replaced by functions that give each run its tokens, seconds and counters (`target_gguf`, `head_gguf`,
`decode_run`): each type written once and loaded by its own runs, one row per drafter × type × K with τ, tokens/s
and speedup, the fastest named in report.json, report.md, the recommendation and the demo's summary, and the
τ agreement computed per head run against the built-in run of the same drafter and K. The engine itself is
tests/test_engine_llamacpp.py (one type, the default).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from draftsmith.configs import compose
from draftsmith.core import DraftsmithError, llamacpp
from draftsmith.core.methods import methods
from draftsmith.demo import llamacpp_summary
from draftsmith.eval import cost
from draftsmith.eval import engine_llamacpp as ll
from draftsmith.eval.engine_vllm import TARGET_ONLY
from draftsmith.eval.metrics import Sample
from draftsmith.eval.report import llamacpp_lines

K = 3
TOKENS = [1, 2, 3, 4]  # every run's output on every prompt: no divergence, so no target runner is needed
N_PROMPTS = 2
# median seconds per prompt of each run: target-only 10 tokens/s; the q8_0 head at K the fastest (2.5x)
SECONDS = {TARGET_ONLY: 0.4, "eagle3-f32": 0.2, "eagle3-f32@K=1": 0.3, "eagle3-q8_0": 0.16, "eagle3-q8_0@K=1": 0.3,
           "ngram": 0.4, "ngram+eagle3-f32": 0.25, "ngram+eagle3-q8_0": 0.2}


def eagle3_drafter() -> SimpleNamespace:
    return SimpleNamespace(method="eagle3", make=lambda: None, engines=methods()["eagle3"].engines,
                           info={"path": "runs/h/final"})


def plan_cfg(outtypes: list[str], sweep_k: list[int]) -> SimpleNamespace:
    return SimpleNamespace(ngram_max=3, sweep_k=sweep_k, drafting=SimpleNamespace(stop_below=0.0),
                           gguf_outtypes=outtypes)


# --------------------------------------------------------------------------- the run plan

def test_one_outtype_keeps_the_run_names_reports_had():
    runs = ll.llamacpp_runs(plan_cfg(["f32"], [5]), eagle3_drafter(), K)
    assert [r["name"] for r in runs] == [TARGET_ONLY, "eagle3", "eagle3@K=5", "ngram", "ngram+eagle3"]
    assert [r["gguf_outtype"] for r in runs] == [None, "f32", "f32", None, "f32"]
    assert all(r["builtin"] == r["name"] for r in runs[1:])  # each compared with the built-in run of its name


def test_several_outtypes_run_the_head_per_type_and_target_only_and_ngram_once():
    drafter = eagle3_drafter()
    runs = ll.llamacpp_runs(plan_cfg(["f32", "q8_0"], [1]), drafter, K)
    assert [r["name"] for r in runs] == [TARGET_ONLY, "eagle3-f32", "eagle3-f32@K=1", "eagle3-q8_0", "eagle3-q8_0@K=1",
                                         "ngram", "ngram+eagle3-f32", "ngram+eagle3-q8_0"]
    by_name = {r["name"]: r for r in runs}
    assert [by_name[n]["gguf_outtype"] for n in by_name] == [None, "f32", "f32", "q8_0", "q8_0", None, "f32", "q8_0"]
    assert [by_name[n].get("k") for n in by_name] == [None, K, 1, K, 1, K, K, K]
    # the built-in decoder decodes each drafter and K once, whatever the GGUF type: both types compare with it
    assert [by_name[n].get("builtin") for n in by_name] == [None, "eagle3", "eagle3@K=1", "eagle3", "eagle3@K=1",
                                                            "ngram", "ngram+eagle3", "ngram+eagle3"]
    assert [by_name[n]["draft"] for n in by_name] == [False, True, True, True, True, False, True, True]
    for outtype in ("f32", "q8_0"):  # the same llama-server flags for each type: only the -md file differs
        flags = cost.llamacpp_settings("eagle3", drafter.engines, 1)["flags"]
        assert by_name[f"eagle3-{outtype}@K=1"]["flags"] == flags
        assert by_name[f"ngram+eagle3-{outtype}"]["flags"] == by_name["ngram+eagle3-f32"]["flags"]
    assert "ngram-simple" in by_name["ngram+eagle3-q8_0"]["flags"][by_name["ngram+eagle3-q8_0"]["flags"].index(
        "--spec-type") + 1]


def test_an_ngram_head_writes_no_gguf_whatever_the_types():
    drafter = SimpleNamespace(method="ngram", make=lambda: None, engines=None, info={})
    runs = ll.llamacpp_runs(plan_cfg(["f32", "f16", "bf16", "q8_0"], [5]), drafter, K)
    assert [(r["name"], r["gguf_outtype"], r["draft"]) for r in runs] == [(TARGET_ONLY, None, False),
                                                                          ("ngram", None, False)]


# --------------------------------------------------------------------------- the report, llama.cpp replaced

def builtin_sample(accepted: list[int], draft_sizes: list[int]) -> Sample:
    return Sample("c", len(TOKENS), len(draft_sizes), 0.2, accepted=accepted,
                  proposed=[len(draft_sizes)] * len(accepted), draft_sizes=draft_sizes, tokens=TOKENS, prompt_ids=[5, 6])


def counters(accepted: list[int], num_drafts: int, draft_tokens: int) -> dict:
    return {"num_drafts": num_drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": sum(accepted),
            "num_accepted_tokens_per_pos": accepted}


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """llamacpp_report of an EAGLE-3 head at gguf_outtypes=[f32,q8_0], sweep_k=[1], on an F32 target conversion:
    (its result, the types written, the GGUF each run loaded)."""
    monkeypatch.setattr(llamacpp, "llamacpp_missing", lambda: None)
    converted = tmp_path / "llamacpp-targets" / "t-f32.gguf"  # as target_gguf names a conversion of the weights
    monkeypatch.setattr(ll, "target_gguf", lambda target, how: converted)
    written = []

    def head_gguf(drafter, write_gguf, target, folder, outtype):
        written.append(outtype)
        folder.mkdir(parents=True)
        (folder / "eagle3.gguf").write_bytes(outtype.encode())
        return folder / "eagle3.gguf"

    loaded = {}

    def decode_run(model, draft, run, prompts, *args):
        loaded[run["name"]] = Path(draft).read_text() if run["draft"] else None
        out = {"tokens": [TOKENS] * len(prompts), "seconds": [SECONDS[run["name"]]] * len(prompts)}
        if run["flags"]:  # the f32 head counts as the built-in decoder does; the q8_0 one accepts a draft less
            c = (counters([1], 2, 2) if run["k"] == 1 else
                 counters([2, 1, 0] if run["gguf_outtype"] != "q8_0" else [2, 0, 0], 2, 6))
            out |= {"counters": ll.pooled([c] * len(prompts)), "per_prompt_counters": [c] * len(prompts)}
        return out

    monkeypatch.setattr(ll, "head_gguf", head_gguf)
    monkeypatch.setattr(ll, "decode_run", decode_run)
    cfg = compose("eval", ["engine=llamacpp", "llamacpp_target=f32", "gguf_outtypes=[f32,q8_0]", "sweep_k=[1]",
                           "head=runs/h/final", "progress=false", f"drafting.num_speculative_tokens={K}"])
    samples = {TARGET_ONLY: [Sample("c", len(TOKENS), len(TOKENS), 0.4, tokens=TOKENS, prompt_ids=[5, 6])] * N_PROMPTS,
               "eagle3": [builtin_sample([2, 1, 0], [3, 3])] * N_PROMPTS,
               "eagle3@K=1": [builtin_sample([1], [1, 1])] * N_PROMPTS}
    setup = SimpleNamespace(cfg=cfg, drafting=cfg.drafting, target=None, runner=None)
    out = ll.llamacpp_report(setup, eagle3_drafter(), samples, {"recommendation": "built-in's"},
                             write_gguf=lambda *args: None)
    return out, written, loaded


def test_each_type_is_written_once_and_loaded_by_its_own_runs(measured):
    out, written, loaded = measured
    assert written == ["f32", "q8_0"]
    assert loaded == {TARGET_ONLY: None, "eagle3-f32": "f32", "eagle3-f32@K=1": "f32", "eagle3-q8_0": "q8_0",
                      "eagle3-q8_0@K=1": "q8_0", "ngram": None, "ngram+eagle3-f32": "f32", "ngram+eagle3-q8_0": "q8_0"}
    assert out["llamacpp"]["head_gguf_outtypes"] == ["f32", "q8_0"]


def test_every_drafter_type_and_k_is_a_row_with_tau_tokens_per_s_and_speedup(measured):
    section = measured[0]["llamacpp"]
    runs = section["runs"]
    assert list(runs) == [n for n in SECONDS if n != TARGET_ONLY]
    assert section["target_only_tokens_per_s"] == pytest.approx(10.0)
    for name, r in runs.items():
        assert r["speculative_tokens_per_s"] == pytest.approx(len(TOKENS) / SECONDS[name]), name
        assert r["speedup"] == pytest.approx(SECONDS[TARGET_ONLY] / SECONDS[name]), name
    assert (runs["eagle3-q8_0"]["gguf_outtype"], runs["eagle3-q8_0"]["k"]) == ("q8_0", K)
    assert (runs["eagle3-f32@K=1"]["gguf_outtype"], runs["eagle3-f32@K=1"]["k"]) == ("f32", 1)
    assert runs["eagle3-f32"]["tau"] == pytest.approx(2.5) and runs["eagle3-q8_0"]["tau"] == pytest.approx(2.0)
    assert runs["ngram"]["gguf_outtype"] is None
    assert section["fastest"] == "eagle3-q8_0"


def test_the_agreement_is_per_head_run_against_the_builtin_run_of_its_drafter_and_k(measured):
    section = measured[0]["llamacpp"]
    runs = section["runs"]
    assert runs["eagle3-f32"]["agreement"]["equal"] and runs["eagle3-f32@K=1"]["agreement"]["equal"]
    assert runs["eagle3-q8_0@K=1"]["agreement"]["equal"]
    assert not runs["eagle3-q8_0"]["agreement"]["equal"]  # it accepted less than the built-in decoder: caught
    assert runs["eagle3-q8_0"]["agreement"]["tau_builtin"] == pytest.approx(2.5)
    assert all("agreement" not in runs[n] for n in ("ngram", "ngram+eagle3-f32", "ngram+eagle3-q8_0"))
    # the F32 target beside the f32 head is the built-in decoder's function (a check), beside q8_0 another (a reading)
    assert [runs[n]["same_function_as_builtin"] for n in ("eagle3-f32", "eagle3-f32@K=1", "eagle3-q8_0", "ngram")] == [
        True, True, False, True]
    # the section's own figures are the evaluated drafter's run at K at the first type
    assert section["tau"] == runs["eagle3-f32"]["tau"] and section["agreement"] == runs["eagle3-f32"]["agreement"]
    assert section["same_function_as_builtin"] is True


def test_report_md_has_a_row_per_run_and_names_the_fastest(measured):
    lines = llamacpp_lines(measured[0])
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in lines if line.startswith("| ")}
    assert set(rows) == {"run"} | set(SECONDS) - {TARGET_ONLY}, rows.keys()  # "run": the header
    assert rows["eagle3-q8_0"].startswith("| eagle3-q8_0 | q8_0 | 3 | 2.000 | 2.500 |")
    assert "| 25.00 | 2.50x |" in rows["eagle3-q8_0"]
    assert "no (quantised target or head: not expected)" in rows["eagle3-q8_0"] and "**no**" not in rows["eagle3-q8_0"]
    assert rows["eagle3-f32@K=1"].startswith("| eagle3-f32@K=1 | f32 | 1 |") and "yes (0.02)" in rows["eagle3-f32@K=1"]
    assert rows["ngram"].startswith("| ngram | - | 3 |")
    assert "Fastest in llama.cpp: eagle3-q8_0 (25.0 tok/s, 2.50x target-only)." in lines
    assert any(line.startswith("- target ") and ", head GGUF f32 / q8_0," in line for line in lines)


def test_the_recommendation_and_the_demo_name_the_fastest_type(measured):
    out = measured[0]
    rec = out["recommendation"]
    assert (rec["drafter"], rec["k"], rec["measured_speedup"]) == ("eagle3-q8_0", K, pytest.approx(2.5))
    assert rec["llamacpp"]["export_command"] == ("draftsmith export head=runs/h/final format=gguf gguf_outtype=q8_0 "
                                                 "out=runs/h/final-gguf")
    assert f"--spec-draft-n-max {K}" in rec["llamacpp"]["command"]
    assert out["builtin_recommendation"] == "built-in's"
    (line,) = llamacpp_summary(out, "smollm2")
    assert "eagle3-q8_0 wins" in line and "eagle3-f32 2.00x" in line and "ngram+eagle3-q8_0 2.00x" in line


def test_the_least_slow_is_named_when_no_run_beats_target_only():
    section = {"version": "v", "target": "/m/t.gguf", "target_weights": "f32", "threads": 2, "counting": "c",
               "target_only_identical_to_builtin": 1.0, "target_only_tokens_per_s": 10.0, "near_tie_eps": 0.25,
               "head_gguf_outtypes": ["f32", "f16"], "fastest": "eagle3-f16",
               "runs": {name: {"k": K, "gguf_outtype": t, "tau": 1.5, "per_position_acceptance": [0.5, 0, 0],
                               "speculative_tokens_per_s": tps, "speedup": tps / 10.0,
                               "greedy_identical_to_engine_target_only": 1.0}
                        for name, t, tps in [("eagle3-f32", "f32", 8.0), ("eagle3-f16", "f16", 9.0)]}}
    lines = llamacpp_lines({"llamacpp": section})
    assert ("Fastest in llama.cpp: none is faster than target-only; eagle3-f16 is the least slow (9.0 tok/s, 0.90x "
            "target-only).") in lines


# --------------------------------------------------------------------------- the option

def test_gguf_outtypes_defaults_to_exports_one_type_and_takes_each_of_the_four():
    assert compose("eval", ["engine=llamacpp"]).gguf_outtypes == [llamacpp.OUTTYPE]
    assert compose("eval", ["engine=llamacpp", f"gguf_outtypes=[{','.join(llamacpp.OUTTYPES)}]"]).gguf_outtypes == list(
        llamacpp.OUTTYPES)


@pytest.mark.parametrize("given, sentence", [
    ("[f32,q4_0]", "gguf_outtypes has 'q4_0'; choose from f32, f16, bf16, q8_0."),
    ("[]", "gguf_outtypes is empty: name at least one of f32, f16, bf16, q8_0."),
    ("[q8_0,f16,q8_0]", "gguf_outtypes has 'q8_0' twice; each type is measured once."),
])
def test_a_wrong_gguf_outtypes_is_refused_in_one_sentence_naming_it(given, sentence):
    with pytest.raises(DraftsmithError) as e:
        compose("eval", ["head=runs/h/final", "engine=llamacpp", f"gguf_outtypes={given}"])
    assert str(e.value) == sentence


def test_evals_old_single_gguf_outtype_points_to_the_list():
    with pytest.raises(DraftsmithError) as e:
        compose("eval", ["head=runs/h/final", "engine=llamacpp", "gguf_outtype=q8_0"])
    assert str(e.value) == "unknown option gguf_outtype for draftsmith eval; did you mean gguf_outtypes?"
