"""(slow) DFlash in the engine: vLLM for CPU loads draftsmith's DFlash export (the `dflash` folder served with
method dflash; the speculators format is exported, not decoded: see WORKING), decodes the same prompts greedily in fp32, and
measures what the built-in decoder measures.

Setup as tests/test_engine_vllm.py, for DFlash alone: the test run's data-gen and DFlash head (conftest.py),
both exports and deliberately broken copies, the built-in decoder on 6 of the training prompts, then ONE vLLM
worker process that builds one `LLM` per run and decodes the prompts together (counters only). Without the engine
venv these tests skip with "vLLM not installed (...)", and fail where DRAFTSMITH_REQUIRE_ENGINE=1.

Asserted, for each working export: vLLM's output is token-identical to vLLM target-only and to draftsmith's
target-only; vLLM's τ and per-position acceptance equal the built-in decoder's within eval/engine_vllm.py's
TOLERANCE, and every verification but the last of each prompt accepted exactly as many tokens in both.

vLLM for CPU (0.32.0) computes the 2-layer drafter otherwise than its own contract: its rms_norm kernel applies
layer 0's k_norm to the context keys of every layer (vllm_worker.grouped_rms_norm_ok; docs/notes/issue22.md
measured drafter logits 0.04-0.10 apart at every cycle because of it, 2e-5 with it emulated). Where the worker's
probe finds that defect, the built-in decoder is compared with the defect emulated (`context_keys_normed_by_layer_0`,
here in the test, never in draftsmith), so the check still asks for step-identical verifications. Each broken copy
(target layers shifted by one; the mask token wrong) must fail the τ check while staying lossless.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from helpers import builtin_decode, counters_job, edited_copy

from draftsmith.configs import compose
from draftsmith.eval import engine_vllm as ev_engine
from draftsmith.eval import run as ev
from draftsmith.export import run as export
from draftsmith.heads import dflash as dflash_head
from draftsmith.core.methods import methods

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(5400)]

K = 3
# 48, as the other engine modules (the built-in target-only reading is shared). This head accepts most drafts, so each
# prompt's last verification (vLLM drafts K there and drops what is past max_tokens; the built-in decoder shortens
# the draft) moved the pooled τ by 0.024 over 48 tokens (docs/notes/issue22.md): eval/engine_vllm.py's `agreement` now
# compares every verification but that one, which was 96 tokens' worth of decoding here before
MAX_TOKENS = 48
# The speculators folder of the same head is exported but not decoded here: it gave exactly the plain folder's
# counters in every measurement (docs/notes/issue22.md: the same weights and config reach the same vLLM model), and
# vLLM's own readers map it to this config in tests/test_heads_dflash.py; decoding it again cost ~2 min of CI on an
# AVX2 CPU
WORKING = ("dflash",)
BROKEN = ("dflash_target_layers_shifted", "dflash_mask_token_wrong")
# A folder with dflash_config.causal = true is not run: with heads this small the mask queries barely attend to one
# another, so running them causally flipped no accept (docs/notes/issue22.md); the flag's reading is checked by vLLM's
# own `_dflash_layer_causal` in tests/test_heads_dflash.py


@pytest.fixture(scope="module")
def exports(engine_data, engine_head, tmp_path_factory, smollm2_target):
    """The session's DFlash head (conftest.py: trained once, offline, block_size K + 1) -> both exports (+ broken
    copies); name -> folder."""
    import json

    root = tmp_path_factory.mktemp("engine-dflash")
    data = engine_data  # conftest.py: made once per test run, read only
    verifier = ev_engine.served_target(smollm2_target)
    head = engine_head("dflash")
    x = {"dflash": export(compose("export", [f"head={head}", "format=dflash", "dtype=float32",
                                            f"out={root / 'x-dflash'}"])),
         "dflash_speculators": export(compose("export", [f"head={head}", "format=speculators", "dtype=float32",
                                                         f"verifier={verifier}",
                                                         f"num_speculative_tokens={K}", f"out={root / 'x-spec'}"]))}
    config = json.loads((x["dflash"] / "config.json").read_text())
    shifted = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    x["dflash_target_layers_shifted"] = edited_copy(x["dflash"], root / "shifted", {
        "eagle_aux_hidden_state_layer_ids": shifted,
        "dflash_config": {**config["dflash_config"], "target_layer_ids": [i - 1 for i in shifted]}})
    x["dflash_mask_token_wrong"] = edited_copy(x["dflash"], root / "mask", {
        "dflash_config": {**config["dflash_config"], "mask_token_id": 0}})
    return {"data": data, **x}


def engine_run(name: str, folder) -> dict:
    if name == "dflash_speculators":  # served as the model: its speculators_config names the verifier and K
        return {"name": name, "k": K, "model": str(folder), "speculative_config": None}
    spec = ev_engine.speculative_config("dflash", methods()["dflash"].engines, str(folder), K)
    return {"name": name, "k": K, "speculative_config": spec}


@contextmanager
def context_keys_normed_by_layer_0():
    """The built-in drafter as vLLM for CPU runs it: every layer's CONTEXT keys normed with layer 0's k_norm (the
    block's own keys keep their layer's, as in vLLM's attention forward)."""
    keys_values, trunk = dflash_head.DFlashAttention.keys_values, dflash_head.DFlashHead.trunk
    now = {}

    def patched_keys_values(self, x, cos, sin):
        if now.get("context") is None or x is not now["context"]:
            return keys_values(self, x, cos, sin)
        own, self.k_norm = self.k_norm, now["k_norm_0"]
        try:
            return keys_values(self, x, cos, sin)
        finally:
            self.k_norm = own

    def patched_trunk(self, input_ids, positions, context, *args, **kwargs):
        now.update(context=context, k_norm_0=self.layers[0].self_attn.k_norm)
        try:
            return trunk(self, input_ids, positions, context, *args, **kwargs)
        finally:
            now["context"] = None

    dflash_head.DFlashAttention.keys_values, dflash_head.DFlashHead.trunk = patched_keys_values, patched_trunk
    try:
        yield
    finally:
        dflash_head.DFlashAttention.keys_values, dflash_head.DFlashHead.trunk = keys_values, trunk


@pytest.fixture(scope="module")
def measured(exports, engine_head, builtin_samples, smollm2_target, tmp_path_factory):
    """(built-in samples, the engine's result): the same prompts, greedy, fp32, K = 3. The built-in DFlash samples
    are the ones that compute what this vLLM computes (see the module docstring): the trained head's own
    (conftest.py), or, where the worker's probe found the k_norm defect, the head with the defect emulated."""
    samples = {ev.TARGET_ONLY: builtin_samples(ev.TARGET_ONLY, MAX_TOKENS)}
    result = counters_job(smollm2_target, samples, MAX_TOKENS,
                          [engine_run(name, exports[name]) for name in WORKING + BROKEN])
    if result.get("grouped_rms_norm_ok") is False:
        with context_keys_normed_by_layer_0():
            samples["dflash"] = builtin_decode(exports["data"], "dflash", engine_head("dflash"), MAX_TOKENS,
                                               tmp_path_factory.mktemp("eval"))
        assert [s.prompt_ids for s in samples["dflash"]] == [s.prompt_ids for s in samples[ev.TARGET_ONLY]]
    else:
        samples["dflash"] = builtin_samples("dflash", MAX_TOKENS)
    return samples, result


@pytest.mark.parametrize("name", WORKING)
def test_dflash_export_in_engine(measured, name, record_property):
    """Loads, greedy output identical to target-only, τ and per-position acceptance equal to the built-in decoder's."""
    samples, result = measured
    run, base = result["runs"][name], result["runs"][ev_engine.TARGET_ONLY]
    assert base["ok"], base.get("error")
    assert run["ok"], f"vLLM refused {name}: {run.get('error')}"
    assert run["tokens"] == base["tokens"] == [s.tokens for s in samples["target_only"]]
    print(name, "grouped_rms_norm_ok", result.get("grouped_rms_norm_ok"))
    agree = ev_engine.agreement(samples["dflash"], run, K)
    record_property("agreement", agree)
    print(name, agree)
    assert agree["equal"], agree
    assert agree["steps_identical_fraction"] == 1.0, agree
    assert agree["per_position_engine"][0] > 0.1, agree  # a trained head: drafts are accepted


@pytest.mark.parametrize("name", BROKEN)
def test_broken_dflash_export_fails_tau_equality(measured, name, record_property):
    samples, result = measured
    run = result["runs"][name]
    assert run["ok"], f"vLLM refused {name}: {run.get('error')}"
    agree = ev_engine.agreement(samples["dflash"], run, K)
    record_property("agreement", agree)
    print(name, agree)
    assert not agree["equal"], agree
    assert run["tokens"] == result["runs"][ev_engine.TARGET_ONLY]["tokens"]  # still lossless: only slower
