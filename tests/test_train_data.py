"""Training data: tiny data-gen folders for the train tests, and the deterministic sampler."""

from __future__ import annotations

import random

import pytest
from helpers import make_tiny_data

from draftsmith.train.data import batch_order, micro_batches


def test_batch_order_is_deterministic_and_bucketed():
    lengths = [random.Random(1).randint(5, 500) for _ in range(100)]
    a = batch_order(lengths, 4, 5, seed=3, epoch=0)
    assert a == batch_order(lengths, 4, 5, seed=3, epoch=0)
    assert a != batch_order(lengths, 4, 5, seed=3, epoch=1)
    assert len(a) == 25 and sorted(i for b in a for i in b) == list(range(100))
    for b in a:  # sorted within a mega-batch: each batch is a contiguous run of lengths
        assert [lengths[i] for i in b] == sorted(lengths[i] for i in b)


def test_micro_batches_split_across_ranks_like_accumulation():
    batch = list(range(8))
    one = micro_batches(batch, 2, rank=0, world=1)
    two = [micro_batches(batch, 2, rank=r, world=2) for r in range(2)]
    assert one == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert two == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


@pytest.mark.parametrize("zero", ["zero1", "zero2", "zero3", "none"])
def test_every_deepspeed_option_composes(zero):
    from draftsmith.configs import compose
    from draftsmith.train.trainer import TrainerConfig, deepspeed_config

    cfg = compose("train", ["target=tiny", "data=/x", f"deepspeed={zero}", "micro_batch_size=2", "grad_accum=3"])
    assert cfg.deepspeed.config == zero and cfg.method.name == "eagle3" and cfg.method.ttt_steps == 3
    if zero != "none":
        ds = deepspeed_config(TrainerConfig.from_train(cfg), world=2)
        assert ds["zero_optimization"]["stage"] == int(zero[-1]) and ds["train_batch_size"] == 12


@pytest.mark.parametrize("damage,needle", [
    ("truncate", "has 100 bytes, its index says"),
    ("empty", "has 0 bytes, its index says"),
    ("delete", "is missing"),
    ("garbage", "is not a readable safetensors file"),  # same size, bad header
])
def test_damaged_shard_is_named_in_one_sentence(tiny_target, tmp_path, damage, needle):
    from draftsmith.core import DraftsmithError
    from draftsmith.train.data import load_data

    folder = make_tiny_data(tmp_path / "d", tiny_target, hidden_states=True)
    shard = folder / "hidden_states" / "shard_00001.safetensors"
    size = shard.stat().st_size
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "empty":
        shard.write_bytes(b"")
    elif damage == "delete":
        shard.unlink()
    else:
        shard.write_bytes(b"\xff" * size)
    with pytest.raises(DraftsmithError) as e:
        load_data(str(folder), tiny_target.identity(), "offline", 64, 0)
    msg = str(e.value)
    assert f"the hidden-state shard {shard} {needle}" in msg and "rerun data-gen" in msg and "\n" not in msg


def test_corrupt_hidden_state_index_is_named(tiny_target, tmp_path):
    from draftsmith.core import DraftsmithError
    from draftsmith.train.data import load_data

    folder = make_tiny_data(tmp_path / "d", tiny_target, hidden_states=True)
    index = folder / "hidden_states" / "index.json"
    index.write_text(index.read_text()[:40])
    with pytest.raises(DraftsmithError, match=f"the hidden-state index {index} is corrupted"):
        load_data(str(folder), tiny_target.identity(), "offline", 64, 0)
