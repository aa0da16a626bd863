"""data-gen under torchrun: ranks split the prompts and the hidden-state shards; the output equals one process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.data_gen.dataset import load_conversations, load_tokenized
from draftsmith.data_gen.run import run

TORCHRUN = Path(sys.executable).with_name("torchrun")
QUESTIONS = [{"question_id": 300 + i, "category": "c", "turns": [f"Question number {i}?"]} for i in range(9)]


def argv(questions, out):
    return ["target=tiny", "prompts=question", f"prompts.path={questions}", "max_new_tokens=5", "temperature=0.7",
            "regenerate_chunk=2", "hidden_states=true", "samples_per_shard=2", "capture_batch_size=1",
            f"out={out}"]


def hidden_files(out: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted((out / "hidden_states").iterdir())}


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_torchrun_two_ranks_capture_their_shards_and_equal_one_process(compose_cfg, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    single, multi = tmp_path / "single", tmp_path / "multi"
    run(compose_cfg("data_gen", *argv(questions, single)))

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK", "NNODES", "NODE_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", DRAFTSMITH_RANK_WAIT_S="120")

    def torchrun():
        # --standalone: torchrun picks a free port (another pytest-xdist worker may be running torchrun too)
        result = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "-m", "draftsmith.cli",
                                 "data-gen", *argv(questions, multi)], env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
        return result

    result = torchrun()
    # both ranks captured: rank r takes shards r, r + 2, ... of the 5 shards (9 samples, 2 per shard)
    # (logged: the CLI's Hydra logging writes to stdout)
    assert "capture: rank 0/2 captured shards [0, 2, 4], kept []" in result.stdout
    assert "capture: rank 1/2 captured shards [1, 3], kept []" in result.stdout
    assert result.stdout.count("data-gen: 9 samples") == 1  # one rank wrote the manifest...
    assert "the last rank to finish writes the index" in result.stdout  # ...the other stopped after its shards

    assert load_tokenized(multi)[0].to_list() == load_tokenized(single)[0].to_list()
    assert load_conversations(multi).to_list() == load_conversations(single).to_list()
    assert hidden_files(multi) == hidden_files(single)  # every shard, byte for byte, and index.json
    manifest = {d: json.loads((d / "manifest.json").read_text()) for d in (single, multi)}
    assert manifest[multi] == manifest[single] and manifest[multi]["hidden_states"]["shards"] == 5
    assert not (multi / "parts").exists()
    assert sorted(p.name for p in (multi / "hidden_states").iterdir()) == \
        ["index.json"] + [f"shard_{s:05d}.safetensors" for s in range(5)]  # no rank index, no lock left

    # resume: a lost shard is recaptured by its rank alone; nothing is regenerated or merged again
    (multi / "hidden_states" / "shard_00003.safetensors").unlink()
    (multi / "manifest.json").unlink()
    result = torchrun()
    assert "capture: rank 0/2 captured shards [], kept [0, 2, 4]" in result.stdout
    assert "capture: rank 1/2 captured shards [3], kept [1]" in result.stdout
    assert "regenerate" not in result.stderr + result.stdout and not (multi / "parts").exists()
    assert hidden_files(multi) == hidden_files(single)
    assert json.loads((multi / "manifest.json").read_text()) == manifest[single]


@pytest.mark.parametrize("local_rank, count, device, expected", [
    ("3", 8, "cuda", "cuda:3"),  # torchrun: every GPU visible, one rank per GPU
    (None, 1, "cuda", "cuda:0"),  # a launcher that sets CUDA_VISIBLE_DEVICES per rank and no LOCAL_RANK
    ("5", 2, "cuda", "cuda:1"),  # fewer visible GPUs than ranks on the node
    ("3", 8, "cuda:2", "cuda:2"),  # an explicit device is kept
    ("3", 0, "cpu", "cpu"),
])
def test_rank_device(monkeypatch, local_rank, count, device, expected):
    import torch

    from draftsmith.data_gen.ranks import rank_device

    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert rank_device(device) == expected
