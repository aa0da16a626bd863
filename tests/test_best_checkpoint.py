"""Acceptance-driven checkpoint selection: held-out E[tau] every eval_every steps, the best head in out/best/
(the final folder's format, loadable), the best-so-far in the resumable state, resume still exact."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from helpers import crash_after_step, make_tiny_data

from draftsmith.configs import check_config
from draftsmith.core import DraftsmithError
from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.heads.eagle3_folders import load_eagle3
from draftsmith.train.config import DeepSpeedConfig, TrainConfig
from draftsmith.train.eagle3 import Eagle3Config
from draftsmith.train.run import run


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    target = load_target(TargetConfig(name="tiny", dtype="float32"))
    return make_tiny_data(tmp_path_factory.mktemp("data"), target, n=14, hidden_states=True)


def _cfg(data, out, **kw):
    options = dict(micro_batch_size=2, grad_accum=1, max_steps=6, save_every=2, keep_last=5, lr=3e-3, warmup_ratio=0.2,
                   val_samples=4, eval_every=2, progress=False, deepspeed=DeepSpeedConfig("none"))
    cfg = OmegaConf.structured(TrainConfig(data=str(data), out=str(out), target=TargetConfig(name="tiny", dtype="float32"),
                                           method=Eagle3Config(draft_vocab_size=128, ttt_steps=3), **{**options, **kw}))
    cfg.wandb.mode = "disabled"
    return check_config("train", cfg)  # the typed tree train's run takes


def test_best_head_is_kept_and_resume_is_exact(tiny_data, tmp_path):
    full = run(_cfg(tiny_data, tmp_path / "full"))
    records = [json.loads(ln) for ln in (tmp_path / "full/metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_etau_greedy" in r]
    assert [r["step"] for r in evals] == [2, 4, 6]
    for r in evals:
        assert 1.0 <= r["val_etau_greedy"] <= 1 + 3 and 1.0 <= r["val_etau_sample"] <= 1 + 3
        assert 0.0 <= r["val_outside_draft"] <= 1.0 and 0.0 <= r["outside_draft"] <= 1.0
    best_step = max(evals, key=lambda r: r["val_etau_greedy"])["step"]  # the first of equals is kept
    assert full["best"]["step"] == best_step and full["best"]["metric"] == "val_etau_greedy"
    assert evals[-1]["best_step"] == best_step
    # out/best is the final folder's format, loadable, and holds the checkpoint weights of the best step
    head = load_eagle3(tmp_path / "full/best")
    assert sorted(p.name for p in (tmp_path / "full/best").iterdir()) == sorted(
        p.name for p in (tmp_path / "full/final").iterdir())
    saved = load_file(str(tmp_path / f"full/checkpoints/step_{best_step:08d}/head.safetensors"))
    for name, tensor in head.state_dict().items():
        if name in saved and name != "embed_tokens.weight":
            torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0, msg=name)
    state = json.loads((tmp_path / "full/checkpoints/step_00000006/train_state.json").read_text())
    assert state["best"]["step"] == best_step

    # killed after step 3, resumed from step 2: same weights bit for bit, same best
    with crash_after_step(3), pytest.raises(RuntimeError, match="simulated crash"):
        run(_cfg(tiny_data, tmp_path / "cut"))
    resumed = run(_cfg(tiny_data, tmp_path / "cut", resume="true"))
    a = load_file(str(tmp_path / "full/checkpoints/step_00000006/head.safetensors"))
    b = load_file(str(tmp_path / "cut/checkpoints/step_00000006/head.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert resumed["best"]["step"] == best_step and resumed["best"]["score"] == full["best"]["score"]
    for name in ("best", "final"):
        x = load_file(str(tmp_path / "full" / name / "model.safetensors"))
        y = load_file(str(tmp_path / "cut" / name / "model.safetensors"))
        assert all(torch.equal(x[k], y[k]) for k in x), name


def test_best_folder_not_written_by_train_is_refused(tiny_data, tmp_path):
    out = tmp_path / "out"
    (out / "best").mkdir(parents=True)
    (out / "best" / "notes.txt").write_text("mine")
    with pytest.raises(DraftsmithError, match="not a head draftsmith train wrote"):
        run(_cfg(tiny_data, out, overwrite=True))
    assert (out / "best" / "notes.txt").read_text() == "mine"


def test_eval_every_needs_held_out_rows(tiny_data, tmp_path):
    with pytest.raises(DraftsmithError, match="eval_every=2 evaluates held-out rows"):
        run(_cfg(tiny_data, tmp_path / "x", val_samples=0))


def test_train_samples_takes_a_prefix_of_the_training_rows(tiny_data, tmp_path):
    """train_samples=N trains on the first N rows left after val_samples (learning curves): an epoch is N / batch
    steps, the vocab map counts only those rows, and more than there are is refused with one sentence."""
    run(_cfg(tiny_data, tmp_path / "p4", train_samples=4, max_steps=None, epochs=1, eval_every=0))
    records = [json.loads(ln) for ln in (tmp_path / "p4/metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records if "step" in r) == 2  # 4 rows, micro-batch 2, one epoch
    state = json.loads(next((tmp_path / "p4/checkpoints").glob("step_*/train_state.json")).read_text())
    assert state["compat"]["train_samples"] == 4
    with pytest.raises(DraftsmithError, match=r"train_samples=11 but .* has 10 training samples \(after val_samples=4\)"):
        run(_cfg(tiny_data, tmp_path / "p11", train_samples=11))
