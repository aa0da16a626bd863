"""The trainer's Logger: wandb mode and fallback, progress lines in a log file, a clean metrics.jsonl."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from draftsmith.configs import check_config
from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.train.config import DeepSpeedConfig, TrainConfig
from draftsmith.train.eagle3 import Eagle3Config
from draftsmith.train.run import run
from draftsmith.train.trainer import Logger, TrainerConfig
from helpers import crash_after_step, make_tiny_data


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    return make_tiny_data(tmp_path_factory.mktemp("data"), load_target(TargetConfig(name="tiny", dtype="float32")), n=8)


def _cfg(data, out, **kw):
    cfg = OmegaConf.structured(TrainConfig(
        data=str(data), out=str(out), target=TargetConfig(name="tiny", dtype="float32"),
        method=Eagle3Config(draft_vocab_size=64, ttt_steps=2),
        micro_batch_size=2, max_steps=3, save_every=100, deepspeed=DeepSpeedConfig("none"), **{"progress": False, **kw}))
    cfg.wandb.mode = "disabled"
    return check_config("train", cfg)  # the typed tree train's run takes


class FakeRun:
    def __init__(self):
        self.logged = []

    def log(self, record, step):
        self.logged.append(step)

    def finish(self):
        pass


@pytest.mark.parametrize("env, want", [({"WANDB_MODE": "offline", "WANDB_API_KEY": "x"}, "offline"),
                                       ({"WANDB_API_KEY": "x"}, "online"),
                                       ({}, "offline")])
def test_wandb_auto_mode(tmp_path, monkeypatch, env, want):
    import wandb

    for key in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    seen = {}
    monkeypatch.setattr(wandb, "init", lambda **kw: seen.update(kw) or FakeRun())
    cfg = _cfg("d", tmp_path)
    cfg.wandb.mode = "auto"
    Logger(TrainerConfig.from_train(cfg), tmp_path, 0, 3, 0, {}).close()
    assert seen["mode"] == want


def test_wandb_that_cannot_start_is_a_warning(tiny_data, tmp_path, monkeypatch, caplog, one_thread):
    import wandb

    def no_network(**kw):
        raise ConnectionError("could not reach api.wandb.ai\nretrying failed")

    monkeypatch.setattr(wandb, "init", no_network)
    cfg = _cfg(tiny_data, tmp_path / "o")
    cfg.wandb.mode = "online"
    result = run(cfg)
    assert result["metrics"]["step"] == 3
    assert len((tmp_path / "o/metrics.jsonl").read_text().splitlines()) == 3
    warn = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "wandb" in r.getMessage()]
    assert warn == ["draftsmith train: warning: wandb (mode=online) did not start (ConnectionError: could not reach "
                    f"api.wandb.ai); training continues without wandb, metrics go to {tmp_path / 'o/metrics.jsonl'} only."]


def test_progress_lines_when_stderr_is_not_a_terminal(tiny_data, tmp_path, monkeypatch, capfd, caplog, one_thread):
    monkeypatch.setenv("DRAFTSMITH_PROGRESS_INTERVAL", "0")
    caplog.set_level("INFO", logger="draftsmith.core.progress")  # progress lines are logged (the CLI shows them)
    capfd.readouterr()
    run(_cfg(tiny_data, tmp_path / "o", progress=True))
    assert "\r" not in capfd.readouterr().err  # no tqdm bar off a terminal
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train: ")]
    assert lines[0].startswith("train: 1/3 (33%)") and "step/s" in lines[0] and "loss=" in lines[0], lines
    assert any(ln.startswith("train: 3/3 (100%)") for ln in lines), lines


def test_fresh_rerun_after_a_crash_starts_metrics_clean(tiny_data, tmp_path, one_thread):
    out = tmp_path / "o"
    with crash_after_step(2), pytest.raises(RuntimeError, match="simulated crash"):
        run(_cfg(tiny_data, out))  # killed before any checkpoint
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "junk": true}\n')
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    run(_cfg(tiny_data, out))  # a fresh run, not resume
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
