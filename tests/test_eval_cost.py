"""The cost model (eval/cost.py): its predicted speedup against a synthetic decoder with known step costs, the
serving settings it recommends parsed as the engines' documented flags, and the static (CUDA-graph) runner path."""

import argparse
import json
import shlex
import types

import pytest
import torch
from helpers import engines_of

from draftsmith.eval import cost, decoder
from draftsmith.eval.decoder import Draft, DraftingConfig, speculative_generate
from draftsmith.core.sampling import SamplingConfig

V = 50


def truth(pos: int) -> int:
    """The synthetic target's greedy token at sequence position `pos`."""
    return (3 * pos + 1) % V


class Clock:
    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t


class FakeRunner:
    """A target whose passes cost t_step * (1 + slope * (T - 1)) virtual seconds (the prefill is free) and whose
    greedy token at position p is truth(p)."""

    def __init__(self, clock, t_step=0.03, slope=0.1, max_len=4096):
        self.clock, self.t_step, self.slope = clock, t_step, slope
        self.max_len, self.vocab_size, self.aux_layer_ids = max_len, V, None
        self.device, self.length = torch.device("cpu"), 0

    def cost(self, n: int) -> float:
        return self.t_step * (1 + self.slope * (n - 1))

    def reset(self):
        self.length = 0

    def commit(self, n):
        self.length = n

    def gather(self, src, dst):
        pass

    def forward(self, tokens, positions, start, attn_mask=None, logits_rows="all", want_aux=False):
        if start > 0:
            self.clock.t += self.cost(tokens.numel())
        logits = torch.full((tokens.numel(), V), -10.0)
        logits[torch.arange(tokens.numel()), [truth(int(p) + 1) for p in positions]] = 10.0
        return (logits[-1:] if logits_rows == "last" else logits), None


class FakeProposer:
    """Drafts K tokens of which the first m are right, m cycling through `pattern`; each costs t_tok seconds."""

    needs_aux = False

    def __init__(self, clock, pattern, t_tok):
        self.clock, self.pattern, self.t_tok = clock, pattern, t_tok
        self.n, self.cycle = 0, 0

    def reset(self, prompt_ids):
        self.n, self.cycle = len(prompt_ids), 0

    def update(self, tokens, aux):
        self.n += len(tokens)

    def propose(self, drafting, sampling, generator=None):
        k = drafting.num_speculative_tokens
        m = self.pattern[self.cycle % len(self.pattern)]
        self.cycle += 1
        self.clock.t += self.t_tok * k
        toks = [truth(self.n + i) if i < m else (truth(self.n + i) + 1) % V for i in range(k)]
        return Draft(toks, list(range(-1, k - 1)))


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_predicted_speedup_matches_a_synthetic_decoder(monkeypatch, k):
    clock = Clock()
    monkeypatch.setattr(decoder, "time", types.SimpleNamespace(perf_counter=clock.now))
    runner = FakeRunner(clock)
    proposer = FakeProposer(clock, pattern=[0, 1, 3, 5, 2, 4], t_tok=0.004)
    prompt = torch.arange(10)
    greedy, drafting = SamplingConfig(), DraftingConfig("chain", k)
    base = speculative_generate(runner, None, prompt, 600, greedy, drafting, eos_token_ids=[])
    spec = speculative_generate(runner, proposer, prompt, 600, greedy, drafting, eos_token_ids=[])
    assert spec.tokens == base.tokens == [truth(10 + i) for i in range(600)]  # lossless, as ever
    measured = (len(spec.tokens) / (spec.prefill_s + spec.decode_s)) / (len(base.tokens) / (base.prefill_s + base.decode_s))

    target = cost.measure_target(runner, 100, range(1, k + 2), repeats=3, clock=clock.now)
    assert target["step_s"] == pytest.approx(0.03) and target["verify_s"][str(k + 1)] == pytest.approx(runner.cost(k + 1))
    acceptance = [a / p for a, p in zip(spec.accepted_per_position, spec.proposed_per_position)]
    run = {"k": k, "tau": spec.tau, "speedup": measured, "mean_draft_size": k,
           "draft_s_per_verification": spec.draft_s / spec.n_verifications}
    assert run["draft_s_per_verification"] == pytest.approx(0.004 * k)
    row = next(r for r in cost.cost_table(target, acceptance, [run]) if r["k"] == k)
    expected_tau = 1 + sum(min(m, k) for m in [0, 1, 3, 5, 2, 4]) / 6
    assert row["predicted_tau"] == pytest.approx(expected_tau, rel=0.02)
    assert row["predicted_speedup"] == pytest.approx(measured, rel=0.02)
    assert row["predicted_speedup"] == pytest.approx(expected_tau * 0.03 / (runner.cost(k + 1) + 0.004 * k), rel=0.02)
    assert row["measured_speedup"] == measured


def test_cost_table_extrapolates_and_picks_the_best_measured_k():
    target = {"step_s": 0.03, "verify_s": {str(n): 0.03 + 0.003 * (n - 1) for n in range(1, 9)}, "tree_verify_s": {}}
    acc = [0.6, 0.4, 0.2, 0.1, 0.05, 0.02, 0.01]
    runs = [{"k": 2, "tau": 2.0, "speedup": 1.3, "draft_s_per_verification": 0.006, "mean_draft_size": 2},
            {"k": 5, "tau": 2.3, "speedup": 1.2, "draft_s_per_verification": 0.015, "mean_draft_size": 5}]
    rows = cost.cost_table(target, acc, runs)
    assert [r["k"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert rows[0]["t_draft_s"] == pytest.approx(0.003)  # K=1 borrows K=2's drafter time per token
    assert rows[6]["t_draft_s"] == pytest.approx(0.015 * 7 / 5)
    assert rows[2]["predicted_tau"] == pytest.approx(2.2)
    assert rows[0]["break_even_tau"] == pytest.approx((0.033 + 0.003) / 0.03)
    assert cost.best_measured(rows)["k"] == 2
    assert cost.best_measured(cost.cost_table(target, acc, [])) is None
    block = cost.cost_table(target, acc, runs, one_forward=True)  # one drafter forward per cycle whatever K
    assert block[0]["t_draft_s"] == pytest.approx(0.006) and block[6]["t_draft_s"] == pytest.approx(0.015)
    assert block[1]["t_draft_s"] == rows[1]["t_draft_s"]  # a decoded K keeps its own


def sglang_parser() -> argparse.ArgumentParser:
    """The flags of SGLang's launch_server the recommendation may use, as SGLang documents them."""
    ap = argparse.ArgumentParser(prog="sglang.launch_server")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--speculative-algorithm", choices=["EAGLE", "EAGLE3", "STANDALONE", "NGRAM"], required=True)
    ap.add_argument("--speculative-draft-model-path")
    ap.add_argument("--speculative-num-steps", type=int)
    ap.add_argument("--speculative-eagle-topk", type=int)
    ap.add_argument("--speculative-num-draft-tokens", type=int)
    return ap


VLLM_KEYS = {"method", "model", "num_speculative_tokens", "parallel_drafting", "prompt_lookup_min", "prompt_lookup_max"}
VLLM_METHODS = {"eagle3", "draft_model", "ngram"}


@pytest.mark.parametrize("method,mode", [("eagle3", "chain"), ("eagle3", "tree"), ("peagle", "chain"),
                                         ("draft", "chain"), ("ngram", "chain"), ("ngram+eagle3", "chain")])
def test_recommended_settings_parse_as_the_engines_flags(method, mode):
    s = cost.serving_settings(method, engines_of(method), "HuggingFaceTB/SmolLM2-135M-Instruct", "runs/head/final", 3,
                              mode,
                              tree_top_k=4, tree_size=12)
    argv = shlex.split(s["vllm"]["command"])
    assert argv[:3] == ["vllm", "serve", "HuggingFaceTB/SmolLM2-135M-Instruct"] and argv[3] == "--speculative-config"
    spec = json.loads(argv[4])
    assert spec == s["vllm"]["config"] and set(spec) <= VLLM_KEYS and spec["method"] in VLLM_METHODS
    assert spec["num_speculative_tokens"] == 3 and ("model" in spec) == (method != "ngram")
    if s["sglang"]["command"] is None:
        assert method == "peagle" and "vLLM" in s["sglang"]["note"]
        return
    argv = shlex.split(s["sglang"]["command"])
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    args = sglang_parser().parse_args(argv[3:])
    assert args.speculative_num_steps == 3
    if mode == "tree":
        assert (args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (4, 13)
    else:
        assert (args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (1, 4)
    assert (args.speculative_draft_model_path is None) == (method == "ngram")


def test_static_runner_path_matches_and_stays_lossless(tiny_target):
    """The CUDA-graph path's eager twin (fixed shapes, device-held slots) gives the same logits and tokens."""
    from draftsmith.eval.proposers.ngram import NgramProposer
    from draftsmith.eval.target_runner import TargetRunner

    model = tiny_target.model.float()
    plain = TargetRunner(model, 256)
    static = TargetRunner(model, 256, static=True)
    assert TargetRunner(model, 256, cuda_graph=True).cuda_graph is False  # no CUDA device: the plain path
    ids = torch.randint(0, tiny_target.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    for r in (plain, static):
        r.reset()
        r.forward(ids[:12], torch.arange(12), 0, logits_rows="none")
        r.commit(12)
    a, _ = plain.forward(ids[12:16], torch.arange(12, 16), 12)
    b, _ = static.forward(ids[12:16], torch.arange(12, 16), 12)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    greedy, chain = SamplingConfig(), DraftingConfig("chain", 3)
    want = speculative_generate(plain, None, ids, 24, greedy, chain, eos_token_ids=[]).tokens
    for proposer in (None, NgramProposer(3, 1)):
        got = speculative_generate(static, proposer, ids, 24, greedy, chain, eos_token_ids=[]).tokens
        assert got == want


@pytest.mark.parametrize("k", [2, 3])
def test_the_decodes_own_clock_holds_where_timed_passes_do_not(monkeypatch, k):
    """Issue 47: on the 2-core Zen 4 an isolated 1-token pass timed 63.5 ms while the decode ran 45 ms a token, and
    the prediction (1.72x) missed the measurement (1.08x). Here the isolated 1-token pass runs 1.4x slower than the
    same pass inside the decode (the longer ones as in it), and the prompt pass costs time (the measured speedup is
    end to end): the prediction on the timed passes misses by more than 25 %, the one on the decode's own clock
    lands within 2 %."""
    from draftsmith.eval.run import to_sample

    clock = Clock()
    monkeypatch.setattr(decoder, "time", types.SimpleNamespace(perf_counter=clock.now))

    class PrefillCosts(FakeRunner):
        def forward(self, tokens, positions, start, attn_mask=None, logits_rows="all", want_aux=False):
            if start == 0:
                self.clock.t += 0.2  # the prompt pass
            return super().forward(tokens, positions, start, attn_mask, logits_rows, want_aux)

    runner = PrefillCosts(clock)
    proposer = FakeProposer(clock, pattern=[0, 1, 3, 5, 2, 4], t_tok=0.004)
    prompt = torch.arange(10)
    greedy, drafting = SamplingConfig(), DraftingConfig("chain", k)
    base = to_sample("x", [speculative_generate(runner, None, prompt, 120, greedy, drafting, eos_token_ids=[])])
    spec = to_sample("x", [speculative_generate(runner, proposer, prompt, 120, greedy, drafting, eos_token_ids=[])])
    measured = (spec.new_tokens / spec.seconds) / (base.new_tokens / base.seconds)

    class SlowOneTokenPass(FakeRunner):  # the isolated 1-token pass runs 1.4x the decode's; the others as in it
        def cost(self, n: int) -> float:
            return super().cost(n) * (1.4 if n == 1 else 1.0)

    isolated = SlowOneTokenPass(clock)
    target = cost.measure_target(isolated, 100, range(1, k + 3), repeats=3, clock=clock.now)
    acceptance = [a / p for a, p in zip(spec.accepted, spec.proposed)]
    run = {"k": k, "tau": spec.emitted_tokens / spec.verifications, "speedup": measured, "mean_draft_size": k,
           "draft_s_per_verification": spec.draft_seconds / spec.verifications}
    clock_ = cost.decode_clock([base], {k: [spec]})
    assert clock_["step_s"] == pytest.approx(0.03) and clock_["by_k"][k]["verify_s"] == pytest.approx(runner.cost(k + 1), rel=0.01)
    row = next(r for r in cost.cost_table(target, acceptance, [run], clock=clock_) if r["k"] == k)
    assert row["predicted_speedup"] == pytest.approx(measured, rel=0.02)
    assert abs(row["predicted_speedup_timed_passes"] / measured - 1) > 0.25
    assert row["timed_step_s"] == pytest.approx(0.042) and row["t_step_s"] == pytest.approx(0.03)
    # a K not decoded: the timed pass scaled by the decode/timed ratio of the nearest decoded K
    longer = acceptance + [0.1]  # an acceptance for K + 1 (a longer run's)
    other = next(r for r in cost.cost_table(target, longer, [run], max_num_speculative_tokens=k + 1, clock=clock_) if r["k"] == k + 1)
    assert other["t_verify_s"] == pytest.approx(runner.cost(k + 2), rel=0.01) and other["measured_speedup"] is None
