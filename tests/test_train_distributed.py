"""Two processes (torchrun, gloo, DeepSpeed ZeRO-2 on CPU) follow the loss trajectory of one process
with the same global batch (micro 2 x accumulation 2 x 1 process == micro 2 x 1 x 2 processes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from draftsmith.data_gen.target import TargetConfig, load_target
from helpers import make_tiny_data

COMMON = ["method=eagle3", "target=tiny", "wandb.mode=disabled", "progress=false", "deepspeed=zero2",
          "method.draft_vocab_size=128", "method.ttt_steps=3", "micro_batch_size=2", "epochs=2", "lr=3e-3", "save_every=100"]


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two torchrun trainings and one single-process training
@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(
    os.path.join(os.path.dirname(sys.executable), "torchrun")), reason="torchrun not installed")
def test_two_processes_match_one(tmp_path):
    data = make_tiny_data(tmp_path / "d", load_target(TargetConfig(name="tiny", dtype="float32")), n=8, hidden_states=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    two = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "draftsmith.cli", "train",
                          *COMMON, f"data={data}", f"out={tmp_path / 'two'}", "grad_accum=1"],
                         env=env, capture_output=True, text=True, timeout=240)
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([sys.executable, "-m", "draftsmith.cli", "train", *COMMON, f"data={data}",
                          f"out={tmp_path / 'one'}", "grad_accum=2"], env=env, capture_output=True, text=True,
                         timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert len(a) == len(b) == 4
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert a[3] < a[1]  # the same batch positions one epoch apart
