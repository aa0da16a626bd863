"""Bad inputs to `draftsmith train`: one sentence each on stderr, exit code 2, nothing overwritten."""

from __future__ import annotations

import json

import pytest

from draftsmith.cli import main
from draftsmith.core.artifacts import read_manifest, write_manifest
from draftsmith.data_gen.target import TargetConfig, load_target
from helpers import make_tiny_data

BASE = ["method=eagle3", "target=tiny", "wandb.mode=disabled", "progress=false", "deepspeed=none",
        "method.draft_vocab_size=64", "method.ttt_steps=2", "micro_batch_size=2"]


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(name="tiny", dtype="float32"))


def _train(capsys, *args) -> str:
    capsys.readouterr()  # drop the fixtures' progress bars
    with pytest.raises(SystemExit) as e:
        main(["train", *BASE, *args])
    assert e.value.code == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if "examples/s" not in ln]
    assert len(err) == 1 and err[0].startswith("draftsmith train: error: "), err
    return err[0]


def test_data_for_another_target(tmp_path, target, capsys):
    data = make_tiny_data(tmp_path / "d", target, n=4)
    m = read_manifest(data)
    write_manifest(data, "data_gen", {**m["target"], "target_hash": "other", "target_id": "other-model"}, m["counts"])
    msg = _train(capsys, f"data={data}", f"out={tmp_path / 'o'}")
    assert "other-model" in msg and "target_hash" in msg
    assert not (tmp_path / "o").exists()


def test_hidden_size_mismatch(tmp_path, target, capsys):
    data = make_tiny_data(tmp_path / "d", target, n=4)
    m = read_manifest(data)
    write_manifest(data, "data_gen", {**m["target"], "hidden_size": 4096}, m["counts"])
    msg = _train(capsys, f"data={data}", f"out={tmp_path / 'o'}")
    assert "hidden_size" in msg


def test_offline_hidden_states_of_other_width(tmp_path, target, capsys):
    data = make_tiny_data(tmp_path / "d", target, n=4, hidden_states=True)
    m = read_manifest(data)
    write_manifest(data, "data_gen", m["target"], m["counts"], hidden_states={**m["hidden_states"], "hidden_size": 32})
    msg = _train(capsys, f"data={data}", f"out={tmp_path / 'o'}")
    assert "hidden_size 32" in msg


def test_empty_dataset(tmp_path, target, capsys):
    data = make_tiny_data(tmp_path / "d", target, n=0)
    msg = _train(capsys, f"data={data}", f"out={tmp_path / 'o'}")
    assert "empty" in msg


def test_resume_other_method_or_config(tmp_path, target, capsys):
    data = make_tiny_data(tmp_path / "d", target, n=4)
    out = tmp_path / "o"
    main(["train", *BASE, f"data={data}", f"out={out}", "max_steps=2", "save_every=1"])
    ckpts = sorted((out / "checkpoints").iterdir())
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}

    state_file = ckpts[-1] / "train_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "method": "peagle"}))
    msg = _train(capsys, f"data={data}", f"out={out}", "max_steps=2", "resume=true")
    assert "'peagle' checkpoint" in msg
    state_file.write_text(json.dumps(state))
    before[state_file] = state_file.stat().st_mtime_ns

    msg = _train(capsys, f"data={data}", f"out={out}", "max_steps=2", "resume=true", "method.draft_vocab_size=32")
    assert "method.draft_vocab_size=64" in msg
    msg = _train(capsys, f"data={data}", f"out={out}", "max_steps=2")  # no resume: refuses to overwrite
    assert "resume=true" in msg
    after = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert after == before


def test_a_killed_deepspeed_op_build_lock_is_refused_not_waited_on(target, tmp_path, monkeypatch, capsys):
    """A `lock` left by a killed JIT build makes DeepSpeed poll forever; train names it in one sentence instead.
    A lock some process still holds open (a build in progress) is not stale, however old."""
    import os

    from draftsmith.train.trainer import stale_extension_locks

    lock = tmp_path / "ext" / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    assert stale_extension_locks(tmp_path / "ext") == []  # young: a build that has just started
    os.utime(lock, (1, 1))
    assert stale_extension_locks(tmp_path / "ext") == [lock]
    with open(lock):  # held open, as torch's FileBaton holds it while building
        assert stale_extension_locks(tmp_path / "ext") == []
    assert stale_extension_locks(tmp_path / "missing") == []

    data = make_tiny_data(tmp_path / "data", target, n=4)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    err = _train(capsys, f"data={data}", f"out={tmp_path / 'out'}", "deepspeed=zero1", "max_steps=1")
    assert str(lock) in err and "delete it" in err and lock.is_file()  # named, not deleted
