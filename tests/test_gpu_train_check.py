"""The training half of the GPU check (benchmarks/gpu_train_check.py, run by scripts/gpu_check.sh on a lent GPU) runs
here on the CPU with tiny shapes, every part, so that it cannot rot while no GPU is at hand: the pipeline (data-gen,
a ZeRO-2 run killed and resumed equal to an uninterrupted one, export, eval), the EAGLE-3 step in each attention,
speculators' own step, capture, and flex against dense."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_train_check.py"

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def test_the_gpu_training_check_runs_every_part_on_the_cpu(tmp_path):
    out = tmp_path / "train.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parts = json.loads(out.read_text())["parts"]
    assert set(parts) == {"kernels", "pipeline", "step", "peer", "capture"}

    kernels = parts["kernels"]["result"]
    for check in ("flex_vs_dense", "flex_vs_dense_checkpointed"):
        assert kernels[check]["loss"] < 1e-10 and kernels[check]["stats"] < 1e-6, kernels

    pipeline = parts["pipeline"]["result"]
    assert pipeline["killed_exit_code"] != 0 and pipeline["steps"] == 6 and pipeline["records_compared"] == 6
    assert pipeline["resume_equal"], pipeline
    assert pipeline["eval_n_prompts"] == 2 and pipeline["eval_tau"] >= 1  # a token per verification at least

    rows = parts["step"]["result"]
    assert all("error" not in r for r in rows), rows
    assert {(r["T"], r["documents"], r["mode"], r["attention"]) for r in rows} == {
        (T, d, mode, attention) for T, d in ((64, 1), (128, 1), (256, 4)) for mode in ("offline", "online")
        for attention in ("dense", "auto")}
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["step_ms"] >= r["forward_ms"] > 0
    by_setting = {}
    for r in rows:  # on a CPU auto is dense: the same step, the same loss
        by_setting.setdefault((r["T"], r["documents"], r["mode"]), set()).add(round(r["loss"], 5))
    assert all(len(losses) == 1 for losses in by_setting.values()), by_setting

    peer = parts["peer"]["result"]
    if importlib.util.find_spec("speculators") is not None:
        assert peer["runs"] and all("error" not in r and r["tokens_per_s"] > 0 for r in peer["runs"]), peer
    assert peer["anchor"]["tokens_per_s"] == 28328  # the published figure, labelled as such

    capture = parts["capture"]["result"]
    assert capture["tokens"] > 0 and capture["bytes_per_token"] > 0 and capture["gpu_busy_share"] is None
