"""Killed midway and resumed == uninterrupted (CPU, fp32), for plain torch and DeepSpeed ZeRO-2."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from draftsmith.configs import check_config
from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.train.config import DeepSpeedConfig, TrainConfig
from draftsmith.train.eagle3 import Eagle3Config
from draftsmith.train.run import run
from helpers import crash_after_step, make_tiny_data


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    target = load_target(TargetConfig(name="tiny", dtype="float32"))
    return make_tiny_data(tmp_path_factory.mktemp("data"), target, n=12, hidden_states=True)


def _cfg(data, out, deepspeed="zero2", method=None, **kw):
    cfg = OmegaConf.structured(TrainConfig(
        data=str(data), out=str(out), target=TargetConfig(name="tiny", dtype="float32"),
        method=Eagle3Config(draft_vocab_size=128, ttt_steps=3, **(method or {})),
        micro_batch_size=2, grad_accum=2, epochs=2, save_every=2, keep_last=5, lr=3e-3, warmup_ratio=0.2,
        progress=False, deepspeed=DeepSpeedConfig(deepspeed), **kw))
    cfg.wandb.mode = "disabled"
    return check_config("train", cfg)  # the typed tree train's run takes


# issue 23's recipe options: the EAGLE-3.1 norms with feature noise (drawn from the checkpointed CPU RNG), and Muon
# (its momentum buffers in the checkpoint's optimizer state)
RECIPES = {"adamw": {}, "norms_noise": {"method": {"norm_before_fc": True, "fc_norm": True, "norm_output": True,
                                                   "feature_noise": 0.05}},
           "muon": {"optimizer": "muon"}}


@pytest.mark.parametrize("deepspeed,recipe", [("none", "adamw"), ("zero2", "adamw"), ("none", "norms_noise"),
                                              ("none", "muon")])
def test_resume_is_exact(tiny_data, tmp_path, deepspeed, recipe):
    options = RECIPES[recipe]
    full = run(_cfg(tiny_data, tmp_path / "full", deepspeed=deepspeed, **options))
    assert full["steps"] == 6
    with crash_after_step(3), pytest.raises(RuntimeError, match="simulated crash"):
        run(_cfg(tiny_data, tmp_path / "cut", deepspeed=deepspeed, **options))
    resumed = run(_cfg(tiny_data, tmp_path / "cut", deepspeed=deepspeed, resume="true", **options))
    a = load_file(str(tmp_path / "full/checkpoints/step_00000006/head.safetensors"))
    b = load_file(str(tmp_path / "cut/checkpoints/step_00000006/head.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    assert resumed["metrics"]["loss"] == pytest.approx(full["metrics"]["loss"], abs=1e-6)
    # the vocab map came from the checkpoint, and the loss went down
    lines = (tmp_path / "full/metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6


@pytest.mark.parametrize("recipe,restore", [("norms_noise", "read_rng"), ("muon", "load_optimizer")])
def test_resume_with_a_recipe_needs_what_the_checkpoint_restores(tiny_data, tmp_path, monkeypatch, recipe, restore):
    """Negative control for the recipe cases above: with the feature noise on, a resume that does not restore the RNG
    (so draws other noise), and with Muon, one that does not restore its optimizer state, end elsewhere."""
    from draftsmith.train import checkpoint as ckpt

    options = RECIPES[recipe]
    run(_cfg(tiny_data, tmp_path / "full", deepspeed="none", **options))
    with crash_after_step(3), pytest.raises(RuntimeError, match="simulated crash"):
        run(_cfg(tiny_data, tmp_path / "cut", deepspeed="none", **options))
    monkeypatch.setattr(ckpt, restore, lambda *args: None)
    run(_cfg(tiny_data, tmp_path / "cut", deepspeed="none", resume="true", **options))
    a = load_file(str(tmp_path / "full/checkpoints/step_00000006/head.safetensors"))
    b = load_file(str(tmp_path / "cut/checkpoints/step_00000006/head.safetensors"))
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point()) > 1e-4
