"""Resume executes nothing from a checkpoint: DeepSpeed's pickles must load with weights_only=True first."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from draftsmith.configs import check_config
from draftsmith.core import DraftsmithError
from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.train import checkpoint as ckpt
from draftsmith.train.config import DeepSpeedConfig, TrainConfig
from draftsmith.train.eagle3 import Eagle3Config
from draftsmith.train.run import run
from helpers import crash_after_step, make_tiny_data

MODEL = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _cfg(data, out, **kw):
    cfg = OmegaConf.structured(TrainConfig(
        data=str(data), out=str(out), target=TargetConfig(name="tiny", dtype="float32"), method=Eagle3Config(draft_vocab_size=64, ttt_steps=2),
        micro_batch_size=2, max_steps=3, save_every=2, progress=False, deepspeed=DeepSpeedConfig("zero2"), **kw))
    cfg.wandb.mode = "disabled"
    return check_config("train", cfg)  # the typed tree train's run takes


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread):
    """(data, out): a zero2 run killed right after its step-2 checkpoint."""
    base = tmp_path_factory.mktemp("trust")
    data = make_tiny_data(base / "data", load_target(TargetConfig(name="tiny", dtype="float32")), n=8, hidden_states=True)
    with crash_after_step(2), pytest.raises(RuntimeError, match="simulated crash"):
        run(_cfg(data, base / "out"))
    return data, base / "out"


def _copy(trained, tmp_path):
    data, out = trained
    shutil.copytree(out, tmp_path / "out")
    state = tmp_path / "out/checkpoints/step_00000002/deepspeed/state"
    assert (state / MODEL).is_file() and (state / OPTIM).is_file()
    return data, tmp_path / "out", state


class Payload:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def test_genuine_zero2_checkpoint_resumes(trained, tmp_path):
    data, out, _ = _copy(trained, tmp_path)
    result = run(_cfg(data, out, resume="true"))
    assert result["metrics"]["step"] == 3
    steps = [__import__("json").loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.mark.parametrize("name", [MODEL, OPTIM])
@pytest.mark.parametrize("how", ["torch.save", "pickle.dump"])
def test_crafted_pickle_is_refused_unexecuted(trained, tmp_path, name, how):
    data, out, state = _copy(trained, tmp_path)
    marker = tmp_path / "pwned"
    target = state / name
    if how == "torch.save":
        torch.save({"module": Payload(marker)}, target)
    else:
        target.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(DraftsmithError) as e:
        run(_cfg(data, out, resume="true"))
    msg = str(e.value)
    assert msg.startswith(f"{target} ") and msg.endswith("so this checkpoint is refused."), msg
    if how == "torch.save":
        assert "needs the global exec," in msg, msg
    assert not marker.exists()
    # the payload is live: a weights_only=False load (DeepSpeed's own) would have run it
    with contextlib.suppress(Exception):  # a raw pickle then fails torch's magic-number check, too late
        torch.load(target, weights_only=False)
    assert marker.exists()


def test_non_torch_file_and_symlink_are_refused(trained, tmp_path):
    data, out, state = _copy(trained, tmp_path)
    (state / "notes.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(DraftsmithError, match="notes.bin is not a torch checkpoint"):
        run(_cfg(data, out, resume="true"))
    (state / "notes.bin").unlink()
    outside = tmp_path / "elsewhere.pt"
    shutil.move(state / OPTIM, outside)
    os.symlink(outside, state / OPTIM)
    with pytest.raises(DraftsmithError, match="symlink"):
        ckpt.verify_deepspeed_files(state.parent.parent)


def test_deepspeed_own_load_is_weights_only_too(trained, tmp_path, monkeypatch):
    """Even a file swapped after the check (or a skipped check) is not executed by DeepSpeed's load."""
    data, out, state = _copy(trained, tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"module": Payload(marker)}, state / MODEL)
    monkeypatch.setattr(ckpt, "verify_deepspeed_files", lambda path: None)
    with pytest.raises(DraftsmithError, match="needs the global exec,"):
        run(_cfg(data, out, resume="true"))
    assert not marker.exists()


def test_fp16_dynamic_loss_scaler_is_allowed(tmp_path):
    """precision=fp16 (GPU only) saves a DynamicLossScaler in the ZeRO optimizer state: it must pass too."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    scaler = DynamicLossScaler(init_scale=2.0 ** 16, scale_window=1000, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False, dtype=torch.float16)
    torch.save({"loss_scaler": scaler, "zero_stage": ZeroStageEnum.gradients}, tmp_path / "optim.pt")
    back = ckpt._restricted_load(tmp_path / "optim.pt")
    assert back["loss_scaler"].__dict__ == scaler.__dict__ and back["zero_stage"] is ZeroStageEnum.gradients
