"""A method's optional `engine_warning(drafter, result)` hook (issue 34): what a method says of a serving engine's
run lives in the method's folders module, reached through its row; eval's vLLM report attaches what the hook says
and names no method. DFlash's hook: vLLM for CPU's rms_norm kernel ignores the stacked k_norm weights of the
context keys (the worker's probe `grouped_rms_norm_ok`), which changes a drafter of two layers or more."""

from __future__ import annotations

import inspect
import logging
import types

import pytest

from draftsmith.core import methods
from draftsmith.core.engine import Engines
from draftsmith.eval import engine_vllm
from draftsmith.heads import dflash_folders

SENTENCE = ("this vLLM (0.32.0) normalizes the context keys of every layer of the 2-layer DFlash drafter with layer "
            "0's k_norm (its rms_norm kernel ignores the stacked per-layer weight that qwen3_dflash.py's "
            "_normalize_context_k passes; vLLM's CUDA kernel takes it), so its tau is that of a slightly different "
            "drafter and can differ from the built-in decoder's and from vLLM's on a GPU")


def _drafter(layers, method="dflash"):
    return types.SimpleNamespace(method=method, info={"num_layers": layers}, engines=Engines(vllm=method))


@pytest.mark.parametrize("layers,ok,warned", [(2, False, True), (1, False, False), (2, True, False), (2, None, False),
                                              (None, False, False)])
def test_dflash_hook_speaks_only_where_the_kernel_changes_the_drafter(layers, ok, warned):
    result = {"vllm_version": "0.32.0"} | ({} if ok is None else {"grouped_rms_norm_ok": ok})
    sentence = dflash_folders.engine_warning(_drafter(layers), result)
    assert sentence == (SENTENCE if warned else None)


def test_the_hook_is_reached_through_the_row_and_is_optional():
    rows = methods.methods()
    assert rows["dflash"].engine_warning is dflash_folders.engine_warning
    assert all(rows[name].engine_warning is None for name in ("eagle3", "peagle", "draft"))


def test_the_call_site_attaches_what_the_hook_says(caplog):
    result = {"vllm_version": "0.32.0", "grouped_rms_norm_ok": False}
    section = {}
    with caplog.at_level(logging.WARNING, logger=engine_vllm.__name__):
        engine_vllm.add_method_warning(section, dflash_folders.engine_warning, _drafter(2), result)
    assert section["warnings"] == [SENTENCE]
    assert caplog.messages == [f"warning: {SENTENCE}"]
    for hook in (None, dflash_folders.engine_warning):  # a method without the hook; the hook saying nothing
        quiet = {}
        engine_vllm.add_method_warning(quiet, hook, _drafter(1), result)
        assert "warnings" not in quiet


@pytest.mark.parametrize("hook,warned", [(dflash_folders.engine_warning, True), (None, False)])
def test_engine_report_passes_its_result_to_the_methods_hook(monkeypatch, hook, warned):
    """engine_report with the engine stood in: the job's result reaches the hook it was given, and its sentence the
    section's warnings."""
    result = {"vllm_version": "0.32.0", "torch_version": "2.x", "grouped_rms_norm_ok": False,
              "runs": {engine_vllm.TARGET_ONLY: {"ok": True, "tokens": [[1, 2]]}}}
    monkeypatch.setattr(engine_vllm, "check_engine_options", lambda cfg: None)
    monkeypatch.setattr(engine_vllm, "engine_runs", lambda cfg, drafter, k: [{"name": engine_vllm.TARGET_ONLY}])
    monkeypatch.setattr(engine_vllm, "served_target", lambda target: "target")
    monkeypatch.setattr(engine_vllm, "engine_job", lambda *a, **kw: {"target": "target", "dtype": "float32"})
    monkeypatch.setattr(engine_vllm.engine, "run_job", lambda job: result)
    monkeypatch.setattr(engine_vllm.engine, "engine_python", lambda: "python")
    monkeypatch.setattr(engine_vllm, "tokens_per_s", lambda run: 1.0)
    monkeypatch.setattr(engine_vllm, "engine_cost_model", lambda section, method, report: None)
    monkeypatch.setattr(engine_vllm, "engine_recommendation", lambda *a: None)
    target = types.SimpleNamespace(eos_token_ids=[0], model=types.SimpleNamespace(dtype="torch.float32"))
    cfg = types.SimpleNamespace(max_new_tokens=2, repeats=1, warmup_prompts=0)
    setup = types.SimpleNamespace(cfg=cfg, drafting=types.SimpleNamespace(num_speculative_tokens=3), target=target)
    sample = types.SimpleNamespace(prompt_ids=[5], tokens=[1, 2])
    out = engine_vllm.engine_report(setup, _drafter(2), {engine_vllm.TARGET_ONLY: [sample]}, {}, "org/target", hook)
    assert out["engine"].get("warnings") == ([SENTENCE] if warned else None)


def test_the_shared_engine_code_names_no_method():
    source = inspect.getsource(engine_vllm)
    assert not any(f'"{name}"' in source for name in ("dflash", "peagle", "eagle3", "draft"))
