"""Eval in its default dtype (auto: bf16 on this AMX CPU) with a K sweep: the cost table, the recommendation, and greedy divergences reported
with the target's top-2 margin (near-ties) instead of a bare 'not identical'."""

import json

import pytest
import torch

from draftsmith.core import machine
from draftsmith.configs import compose
from draftsmith.eval import metrics
from draftsmith.eval.decoder import DraftingConfig, speculative_generate
from draftsmith.eval.run import run
from draftsmith.eval.target_runner import TargetRunner, divergence
from draftsmith.core.sampling import SamplingConfig


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": c, "turns": [t]} for i, (c, t) in enumerate(
        [("writing", "Write a poem about the sea and the sea."), ("math", "What is 1 + 1 + 1 + 1 + 1?"),
         ("writing", "Tell me a story about a cat, a cat and a dog.")])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bf16_default_with_k_sweep(questions, tmp_path):
    cfg = compose("eval", ["target=tiny", f"prompts.path={questions}", "prompts.n=null", "max_new_tokens=16",
                           "repeats=1", "progress=false", "head=ngram", "drafting.num_speculative_tokens=3",
                           "sweep_k=[1,2]", "cost_repeats=1", f"out={tmp_path / 'out'}"])
    assert cfg.target.dtype == "auto"  # (was bfloat16: auto is the default now) what this machine runs fastest
    auto = machine.dtype_name(machine.resolve_dtype("auto", "cpu")[0])
    report = run(cfg)
    assert report["target_dtype"] == auto and report["cuda_graph"] is False
    # why that dtype, and what it measured here: one verification of K+1 tokens in decode steps (the cost model)
    assert report["target_dtype_why"] == machine.resolve_dtype("auto", "cpu")[1]
    cost = report["target_dtype_cost"]
    assert cost["dtype"] == auto and cost["verify_tokens"] == 4
    assert cost["verify_over_step"] == pytest.approx(report["cost_model"]["table"][2]["verify_over_step"])
    assert report["machine"]["cpu"] and f"dtype: {auto}" in (tmp_path / "out" / "config.yaml").read_text()
    table = report["cost_model"]["table"]
    assert [r["k"] for r in table] == [1, 2, 3]
    assert all(r["measured_speedup"] is not None and r["predicted_speedup"] > 0 for r in table)
    assert [r["k"] for r in report["k_sweep"]] == [1, 2, 3]
    assert report["k_sweep"][2]["tau"] == pytest.approx(report["tau"])  # K=3 is the main row
    target = report["cost_model"]["target"]
    assert set(target["verify_s"]) == {"1", "2", "3", "4"} and target["step_s"] == target["verify_s"]["1"]
    rec = report["recommendation"]
    best = max(report["k_sweep"], key=lambda r: (r["speedup"], -r["k"]))
    assert rec["k"] == best["k"] and rec["measured_speedup"] == pytest.approx(best["speedup"])
    assert json.loads(rec["vllm"]["command"].split("'")[1])["num_speculative_tokens"] == rec["k"]
    assert "ngram" not in report["baselines"] and not any("@K=" in b for b in report["baselines"])
    # greedy in bf16: every divergence carries its position and margin; near-ties are counted separately
    near = report["greedy_identical_up_to_near_ties_fraction"]
    assert near >= report["greedy_identical_fraction"]
    n = report["n_samples"]
    assert len(report["divergences"]) == round((1 - report["greedy_identical_fraction"]) * n)
    for d in report["divergences"]:
        assert d["margin"] >= 0 and d["position"] >= 0
    assert near == pytest.approx((n - sum(d["margin"] >= report["near_tie_eps"] for d in report["divergences"])) / n)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Cost model" in md and "## Recommendation" in md and "vllm serve" in md
    assert "identical up to near-ties" in md
    assert f"- target dtype: {auto} ({report['target_dtype_why']}); measured here in {auto}: verifying K+1 = 4 " \
           f"tokens costs {cost['verify_over_step']:.2f} decode steps (cost model)" in md
    assert (tmp_path / "out" / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_divergence_reports_the_targets_top2_margin(tiny_target):
    model = tiny_target.model.float()
    runner = TargetRunner(model, 128)
    prompt = torch.randint(0, tiny_target.vocab_size, (8,), generator=torch.Generator().manual_seed(3))
    ref = speculative_generate(runner, None, prompt, 10, SamplingConfig(), DraftingConfig(), eos_token_ids=[])
    other = speculative_generate(runner, None, prompt, 10, SamplingConfig(), DraftingConfig(), eos_token_ids=[])
    other.tokens = ref.tokens[:4] + [(ref.tokens[4] + 1) % tiny_target.vocab_size] + ref.tokens[5:]
    d = divergence(runner, ref.prompt_ids, ref.tokens, other.tokens)
    with torch.no_grad():  # the margin, recomputed by transformers' own forward
        logits = model(torch.tensor([prompt.tolist() + ref.tokens[:4]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    assert d["position"] == 4 and d["target_token"] == ref.tokens[4] == int(logits.argmax())
    assert d["margin"] == pytest.approx(float(top[0] - top[1]), abs=1e-4)
    assert d["other_rank"] >= 1


def test_identical_up_to_near_ties():
    s = [metrics.Sample("c", 1, 1, 1.0, identical=True),
         metrics.Sample("c", 1, 1, 1.0, identical=False, divergence={"margin": 0.05}),
         metrics.Sample("c", 1, 1, 1.0, identical=False, divergence={"margin": 0.9}),
         metrics.Sample("c", 1, 1, 1.0)]
    assert metrics.identical_up_to_near_ties(s, 0.25) == pytest.approx(2 / 3)
    assert metrics.identical_up_to_near_ties(s, 1.0) == 1.0
    assert metrics.identical_up_to_near_ties(s[3:], 0.25) is None
