"""Training data: tiny data-gen folders for the train tests, and the deterministic sampler."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from draftsmith.train.data import batch_order, micro_batches


def make_tiny_data(folder, target, n: int = 12, min_len: int = 10, max_len: int = 24, seed: int = 0,
                   hidden_states: bool = False) -> Path:
    """A data-gen-shaped folder (tokenized/, manifest.json, optional hidden_states/) for `target`."""
    import datasets

    from draftsmith.data_gen.capture import capture_hidden_states
    from draftsmith.core.artifacts import write_manifest

    folder = Path(folder)
    rng = random.Random(seed)
    ids, masks = [], []
    for _ in range(n):
        T = rng.randint(min_len, max_len)
        prompt = rng.randint(2, T // 2)
        # a learnable pattern: repeated short motifs from a small alphabet
        motif = [rng.randint(97, 110) for _ in range(3)]
        ids.append([rng.randint(0, 255) for _ in range(prompt)] + [motif[i % 3] for i in range(T - prompt)])
        masks.append([0] * prompt + [1] * (T - prompt))
    ds = datasets.Dataset.from_dict({"id": [f"s{i}" for i in range(n)], "input_ids": ids, "loss_mask": masks},
                                    features=datasets.Features({"id": datasets.Value("string"),
                                                                "input_ids": datasets.Sequence(datasets.Value("int32")),
                                                                "loss_mask": datasets.Sequence(datasets.Value("int8"))}))
    ds.save_to_disk(str(folder / "tokenized"))
    hidden = None
    if hidden_states:
        index = capture_hidden_states(target, ids, folder / "hidden_states", "float32", samples_per_shard=5)
        hidden = {k: index[k] for k in ("dtype", "aux_layer_ids", "last_hidden_state", "hidden_size")}
    counts = {"samples": n, "tokens": sum(map(len, ids)), "loss_tokens": sum(map(sum, masks))}
    write_manifest(folder, stage="data_gen", target=target.identity(), counts=counts, hidden_states=hidden)
    return folder


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
