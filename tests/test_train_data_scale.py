"""Training data at scale: tokens read flat from the memory-mapped Arrow set, packing (first-fit rows, positions and
document ids, the target run on a packed row equal to each conversation alone), and the prefetch thread."""

from __future__ import annotations

import contextlib
import threading

import datasets
import numpy as np
import pytest
import torch

from draftsmith.core import DraftsmithError
from draftsmith.data_gen.dataset import TokenRows
from draftsmith.train.data import (batch_order, collate, load_data, micro_batch_plan, micro_batches, pack_rows,
                                   prefetch)
from tests.test_train_data import make_tiny_data

MAX_LENGTH = 20  # below make_tiny_data's longest (24): some rows are cut


@pytest.fixture(scope="module")
def offline(tiny_target, tmp_path_factory):
    folder = make_tiny_data(tmp_path_factory.mktemp("scale") / "d", tiny_target, n=12, hidden_states=True)
    return folder, load_data(str(folder), tiny_target.identity(), "offline", MAX_LENGTH, 2)


def list_reference(folder, max_length):
    """What load_data held before (77bd05a): Python lists, cut at max_length, and the rows it kept."""
    ds = datasets.load_from_disk(str(folder / "tokenized"))
    ids = [list(x)[:max_length] for x in ds["input_ids"]]
    masks = [list(x)[:max_length] for x in ds["loss_mask"]]
    return ids, masks, [i for i in range(len(ids)) if len(ids[i]) >= 2 and sum(masks[i]) > 0]


def padded_reference(ids, masks, rows):
    """The right-padded micro-batch collate built before, from the lists."""
    T = max(len(ids[r]) for r in rows)
    out = {k: torch.zeros(len(rows), T, dtype=torch.long) for k in ("input_ids", "attention_mask", "loss_mask")}
    for b, r in enumerate(rows):
        n = len(ids[r])
        out["input_ids"][b, :n] = torch.tensor(ids[r])
        out["attention_mask"][b, :n] = 1
        out["loss_mask"][b, :n] = torch.tensor(masks[r])
    return out


def test_flat_rows_equal_the_lists(offline):
    folder, (train, val, mode) = offline
    ids, masks, keep = list_reference(folder, MAX_LENGTH)
    assert mode == "offline" and train.indices + val.indices == keep and len(train.input_ids) == len(ids)
    assert [len(x) for x in ids if len(x) == MAX_LENGTH], "no row was cut: the test would not see max_length"
    for r in range(len(ids)):
        assert train.input_ids[r].tolist() == ids[r] and train.loss_mask[r].tolist() == masks[r]
    assert train.lengths() == [len(ids[r]) for r in train.indices]
    assert not train.input_ids[0].flags.writeable  # a view of the Arrow buffer, not a copy
    positions = [0, 3, 5]
    batch = collate(train, positions, "cpu")
    expected = padded_reference(ids, masks, [train.indices[p] for p in positions])
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask", "aux", "last", "target_top", "target_lse"}
    for key, value in expected.items():
        assert torch.equal(batch[key], value), key


def test_flat_rows_across_arrow_chunks_and_shards(tmp_path):
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 1000, int(rng.integers(1, 30))).tolist() for _ in range(50)]
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
    datasets.Dataset.from_dict({"input_ids": rows}, features=features).save_to_disk(str(tmp_path / "t"), num_shards=3)
    ds = datasets.load_from_disk(str(tmp_path / "t"))
    assert ds.data.column("input_ids").num_chunks >= 3  # several memory-mapped files, each its own chunk
    flat = TokenRows(ds, "input_ids", 12)
    assert [flat[i].tolist() for i in range(len(rows))] == [r[:12] for r in rows]
    assert flat.lengths().tolist() == [min(len(r), 12) for r in rows]
    picked = ds.select([7, 3, 40])  # an indices mapping: made plain first
    assert [TokenRows(picked, "input_ids", 99)[i].tolist() for i in range(3)] == [rows[7], rows[3], rows[40]]


def test_pack_rows_first_fit_in_order():
    assert pack_rows([5, 3, 4, 2, 6], 8) == [[0, 1], [2, 3], [4]]
    assert pack_rows([6, 5, 2, 3], 8) == [[0, 2], [1, 3]]  # 2 goes back to the first row, 3 to the second
    assert pack_rows([2, 7, 1, 6], 8) == [[0, 2], [1], [3]]  # the first row that fits, not the fullest
    assert pack_rows([3, 3, 3], 3) == [[0], [1], [2]]
    with pytest.raises(DraftsmithError, match="a conversation of 9 tokens does not fit pack_tokens=8"):
        pack_rows([4, 9], 8)


def test_packed_layout(offline):
    _, (train, _, _) = offline
    positions = list(range(8))
    budget = 48
    n = [len(train.input_ids[train.indices[p]]) for p in positions]
    layout = pack_rows(n, budget)
    assert 1 < len(layout) < len(positions), "the test needs rows of several conversations, and more than one row"
    packed = collate(train, positions, "cpu", pack_tokens=budget)
    alone = collate(train, positions, "cpu", pack_tokens=0)
    again = collate(train, positions, "cpu", pack_tokens=budget)
    assert all(torch.equal(packed[k], again[k]) for k in packed)  # deterministic
    B, T = packed["input_ids"].shape
    assert B == len(layout) and T == max(sum(n[k] for k in docs) for docs in layout) <= budget
    for key in ("position_ids", "document_ids"):
        assert packed[key].shape == (B, T) and packed[key].dtype == torch.long
    for b, docs in enumerate(layout):
        start = 0
        for j, k in enumerate(docs):
            s = slice(start, start + n[k])
            assert torch.equal(packed["position_ids"][b, s], torch.arange(n[k]))
            assert (packed["document_ids"][b, s] == j).all()
            for key in ("input_ids", "attention_mask", "loss_mask", "aux", "last", "target_top", "target_lse"):
                assert torch.equal(packed[key][b, s], alone[key][k, :n[k]]), key
            start += n[k]
        assert (packed["attention_mask"][b, start:] == 0).all() and (packed["document_ids"][b, start:] == -1).all()
    assert packed["attention_mask"].sum() == alone["attention_mask"].sum() == sum(n)
    assert train.pack_tokens == 0 and "position_ids" not in alone  # off: today's batch keys


def test_packed_target_equals_each_conversation_alone(tiny_target, tmp_path):
    from draftsmith.data_gen.target import TargetConfig, load_target
    from draftsmith.train.features import target_prepare

    target = load_target(TargetConfig(name="tiny", dtype="float64"))
    folder = make_tiny_data(tmp_path / "d", tiny_target, n=6, min_len=6, max_len=14, seed=3)
    train, _, _ = load_data(str(folder), target.identity(), "online", 64, 0, pack_tokens=64)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[::3] = True  # a draft vocab of a third: probabilities renormalised, argmax often outside it
    prepare = target_prepare(t2d, target, "online", contextlib.nullcontext)
    positions = list(range(5))
    n = [len(train.input_ids[train.indices[p]]) for p in positions]
    packed = prepare(collate(train, positions, "cpu"))
    assert packed["input_ids"].shape[0] == 1 and packed["document_ids"].max() == len(positions) - 1  # one row of all
    start = 0
    for p, m in zip(positions, n):
        alone = prepare(collate(train, [p], "cpu", pack_tokens=0))
        s = slice(start, start + m)
        assert packed["aux"].dtype == torch.float64
        torch.testing.assert_close(packed["aux"][0, s], alone["aux"][0], rtol=0, atol=1e-10)
        for field in ("probs", "in_mass"):
            torch.testing.assert_close(getattr(packed["target"], field)[0, s], getattr(alone["target"], field)[0],
                                       rtol=0, atol=1e-10)
        for field in ("argmax", "argmax_in_draft"):
            assert torch.equal(getattr(packed["target"], field)[0, s], getattr(alone["target"], field)[0])
        start += m


def test_micro_batch_plan_is_the_loops_order_and_resumes():
    lengths = [(i * 37) % 50 + 2 for i in range(40)]
    mbs, ga, world, seed, mega = 2, 3, 2, 5, 2
    global_batch = mbs * ga * world
    per_epoch = len(lengths) // global_batch
    for rank in range(world):
        loop = []
        for step in range(7):  # the trainer's loop: batch_order per epoch, micro_batches per step
            epoch, b = divmod(step, per_epoch)
            loop += micro_batches(batch_order(lengths, global_batch, mega, seed, epoch)[b], mbs, rank, world)
        plan = list(micro_batch_plan(lengths, global_batch, mega, seed, mbs, rank, world, 0, 7))
        assert plan == loop
        assert list(micro_batch_plan(lengths, global_batch, mega, seed, mbs, rank, world, 4, 7)) == plan[4 * ga:]


@pytest.mark.parametrize("pack", [0, 48])
@pytest.mark.parametrize("depth", [2, None])
def test_prefetch_equals_collate_in_order(offline, pack, depth):
    """With a reading thread (depth 2) and as on a CPU by default (depth None: no thread, read when due)."""
    _, (train, _, _) = offline
    train.pack_tokens = pack
    try:
        plan = list(micro_batch_plan(train.lengths(), 4, 2, 0, 2, 0, 1, 0, 6))
        threads = threading.active_count()
        stream = prefetch(train, iter(plan), "cpu", depth=depth)
        first = next(stream)
        assert (threading.active_count() > threads) == (depth is not None)  # the CPU default starts no thread
        got = [first, *stream]
        assert len(got) == len(plan) == 12
        for positions, batch in zip(plan, got):
            expected = collate(train, positions, "cpu")
            assert batch.keys() == expected.keys() and ("position_ids" in batch) == bool(pack)
            for key in expected:
                assert torch.equal(batch[key], expected[key]), key
    finally:
        train.pack_tokens = 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory and the asynchronous copy need CUDA")
def test_prefetch_pins_host_batches_for_cuda(offline):
    from draftsmith.train.data import host_batch

    _, (train, _, _) = offline
    assert all(v.is_pinned() for v in host_batch(train, [0, 1], pin=True, pack_tokens=48).values())
    plan = [[0, 1], [2, 3], [4, 5]]
    for positions, batch in zip(plan, prefetch(train, iter(plan), "cuda", depth=2)):
        expected = collate(train, positions, "cpu")
        assert all(batch[k].is_cuda and torch.equal(batch[k].cpu(), expected[k]) for k in expected)


def test_prefetch_error_is_raised_in_the_caller(offline, monkeypatch):
    _, (train, _, _) = offline
    plan = [[0, 1], [2, 3], [4, 5], [6, 7]]
    broken = train.indices[4]
    read = type(train.hidden).__getitem__
    failure = OSError(f"read of row {broken} failed")

    def flaky(self, i):
        if i == broken:
            raise failure
        return read(self, i)

    monkeypatch.setattr(type(train.hidden), "__getitem__", flaky)
    stream = prefetch(train, iter(plan), "cpu", depth=1)
    for positions in plan[:2]:  # the micro-batches before the failing one come, in order
        assert torch.equal(next(stream)["input_ids"], collate(train, positions, "cpu")["input_ids"])
    with pytest.raises(OSError) as raised:
        next(stream)
    assert raised.value is failure
    assert not [t for t in threading.enumerate() if t.name == "draftsmith-prefetch"]


def test_prefetch_closed_early_stops_its_thread(offline):
    _, (train, _, _) = offline
    stream = prefetch(train, iter([[0, 1]] * 50), "cpu", depth=2)
    next(stream)
    stream.close()
    assert not [t for t in threading.enumerate() if t.name == "draftsmith-prefetch"]


@pytest.mark.parametrize("overrides,expected", [
    (["method=draft", "pack_tokens=4096"], "pack_tokens=4096 packs conversations for method=eagle3 only; method=draft"),
    (["method=peagle", "pack_tokens=4096"], "method=peagle's step reads one right-padded conversation per row"),
    (["method=eagle3", "max_length=2048", "pack_tokens=1024"], "pack_tokens=1024 is less than max_length=2048"),
    (["method=eagle3", "pack_tokens=-1"], "pack_tokens=-1 must be at least 0"),
])
def test_pack_tokens_refusals(compose_cfg, overrides, expected):
    with pytest.raises(DraftsmithError, match=expected.replace("(", r"\(")):
        compose_cfg("train", "target=tiny", "data=/x", *overrides)


def test_pack_tokens_composes_for_eagle3(compose_cfg):
    cfg = compose_cfg("train", "target=tiny", "data=/x", "method=eagle3", "max_length=512", "pack_tokens=2048")
    assert cfg.pack_tokens == 2048 and compose_cfg("train", "target=tiny", "data=/x").pack_tokens == 0
