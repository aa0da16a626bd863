"""The trainer's collectives are right on any device (issue 46, item 1), checked on the CPU with a toy step:

- the step's reduction runs whenever a process group exists, world 1 included, on the group's device;
- device=cuda asks for a group that serves CPU and CUDA tensors ("cpu:gloo,cuda:nccl") and takes LOCAL_RANK's GPU
  first (NCCL alone cannot reduce a CPU tensor; gloo on CPU would never show it);
- a step syncs with the host once (counted with a TorchFunctionMode);
- DDP skips the gradient all-reduce on a step's accumulation micro-batches (no_sync).
"""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from draftsmith.core import distributed
from draftsmith.train import trainer
from draftsmith.train.data import TrainData
from draftsmith.train.trainer import Wrapped, cosine_lambda, init_distributed, train_loop

GRAD_ACCUM, MICRO, STEPS = 2, 2, 3


class Toy(nn.Module):
    """A step without host syncs: an embedding, a masked squared loss, (1, 2) stats."""

    def __init__(self):
        super().__init__()
        self.drafter = nn.Embedding(16, 4)

    def forward(self, input_ids, attention_mask, loss_mask):
        h = self.drafter(input_ids)  # (B, T, 4)
        loss = (h.pow(2).sum(-1) * loss_mask).sum() / loss_mask.sum()
        return loss, torch.stack([loss.detach(), loss_mask.sum().float()])[None]


class FakeDDP(nn.Module):
    """DDP's surface for the loop: forward, and no_sync, which records where each forward and backward ran."""

    def __init__(self, module):
        super().__init__()
        self.module, self.inside, self.forwards, self.backwards = module, False, [], []

    @contextlib.contextmanager
    def no_sync(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def forward(self, **batch):
        loss, stats = self.module(**batch)
        self.forwards.append(self.inside)
        loss.register_hook(lambda g: self.backwards.append(self.inside) or g)  # runs in backward
        return loss, stats


class Rows(list):
    """Token rows as train/data.py reads them: row i (a numpy array) and every row's length."""

    def lengths(self) -> np.ndarray:
        return np.array([len(x) for x in self], dtype=np.int32)


def _data(n: int = 12) -> TrainData:
    ids = Rows(np.array([(i * 3 + t) % 16 for t in range(3 + i % 4)], dtype=np.int64) for i in range(n))
    return TrainData(input_ids=ids, loss_mask=Rows(np.ones(len(x), dtype=np.int64) for x in ids), hidden=None,
                     manifest={}, indices=list(range(n)))


def _cfg(**kw) -> SimpleNamespace:
    return SimpleNamespace(device="cpu", seed=0, precision="fp32", micro_batch_size=MICRO, grad_accum=GRAD_ACCUM,
                           mega_batch=1, eval_every=0, log_every=1, save_every=10_000, keep_last=1,
                           select_by="auto", **kw)


def _wrapped(wrap=None) -> Wrapped:
    torch.manual_seed(0)
    module = Toy()
    # SGD: AdamW reads its per-parameter step counter with .item(), a CPU tensor even on a GPU (not a device sync),
    # which the counter below could not tell from one.
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_lambda(1, STEPS, 0.1))
    return Wrapped(module, wrap(module) if wrap else module, optimizer, scheduler, None, GRAD_ACCUM, 1.0)


class Records:
    def __init__(self):
        self.records = []

    def log(self, record):
        self.records.append(record)


def _train(monkeypatch, tmp_path, w: Wrapped, summarize=lambda stats: {}) -> list[dict]:
    monkeypatch.setattr(trainer, "save_checkpoint", lambda *a, **k: None)  # the steps, not the final checkpoint
    logger = Records()
    train_loop(w, _cfg(), _data(), lambda batch: batch, summarize, tmp_path, 0, 1, STEPS, 0, {}, logger)
    return logger.records


@contextlib.contextmanager
def _process_group():
    """A gloo group of one process (as init_distributed makes for DeepSpeed alone); one left by an earlier
    in-process DeepSpeed run is used as it is."""
    created = not dist.is_initialized()
    if created:
        distributed.init_group("cpu", 1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def test_the_step_reduces_at_world_1_on_the_groups_device(monkeypatch, tmp_path):
    seen = []
    reduce = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        seen.append(tensor.device)
        return reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recording)
    with _process_group():
        expected = distributed.collective_device()
        records = _train(monkeypatch, tmp_path, _wrapped())
    assert len(records) == STEPS
    assert seen and len(seen) >= STEPS  # the step's record, every step, though the world is one process
    assert all(device == expected for device in seen), (seen, expected)
    no_group = _train(monkeypatch, tmp_path, _wrapped())  # without a group nothing is reduced: the same figures
    assert [{k: v for k, v in r.items() if k not in ("step_s", "tokens_per_s")} for r in records] == \
        [{k: v for k, v in r.items() if k not in ("step_s", "tokens_per_s")} for r in no_group]


@pytest.mark.parametrize("deepspeed, world, local_rank, device, expected_gpu", [
    ("none", 2, "1", "cuda", 1),  # torchrun, plain torch DDP: LOCAL_RANK's GPU
    ("none", 4, "3", "cuda:3", 3),  # train/run.py hands each process cuda:LOCAL_RANK
    ("zero2", 1, None, "cuda", 0),  # DeepSpeed alone: the private group
])
def test_init_distributed_on_cuda_serves_both_devices_and_sets_the_gpu(monkeypatch, deepspeed, world, local_rank,
                                                                        device, expected_gpu):
    calls, gpus, adopted = [], [], []
    for key, value in (("WORLD_SIZE", str(world)), ("RANK", "0"), ("LOCAL_RANK", local_rank)):
        monkeypatch.setenv(key, value or "0")
        if value is None:
            monkeypatch.delenv(key)  # (set first, so that the setdefault of the run is undone too)
    if world == 1:
        monkeypatch.delenv("WORLD_SIZE")
        monkeypatch.delenv("RANK")
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(dist, "get_backend", lambda *a: calls[-1][0])
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: world)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: gpus.append((d, len(calls))))
    monkeypatch.setitem(sys.modules, "deepspeed", SimpleNamespace(init_distributed=lambda **kw: adopted.append(kw)))
    assert init_distributed(SimpleNamespace(device=device, deepspeed=deepspeed)) == (0, world)
    assert [backend for backend, _ in calls] == ["cpu:gloo,cuda:nccl"]
    assert gpus == [(expected_gpu, 0)]  # before the group, so before any collective
    if deepspeed != "none":
        assert adopted == [{"dist_backend": "cpu:gloo,cuda:nccl"}]


def test_backends_and_the_collective_device(monkeypatch):
    assert distributed.backend_for("cpu") == "gloo"
    assert distributed.backend_for("cuda:2") == "cpu:gloo,cuda:nccl"
    monkeypatch.setattr(dist, "get_backend", lambda *a: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert distributed.collective_device() == torch.device("cuda", 2)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    assert distributed.collective_device() == torch.device("cpu")


SYNCS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "equal",
         "allclose", "is_nonzero"}


class CountSyncs(TorchFunctionMode):
    """Counts the tensor calls that make the host wait for the device (on a GPU)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNCS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_one_host_sync_per_optimizer_step(monkeypatch, tmp_path):
    got = []
    with CountSyncs() as counter:
        records = _train(monkeypatch, tmp_path, _wrapped(), summarize=lambda stats: got.append(stats) or {})
    assert len(records) == STEPS
    assert len(counter.calls) <= STEPS, counter.calls
    assert all(s.shape == (1, 2) and s.device.type == "cpu" for s in got)  # summarize reads a host copy


def test_ddp_skips_the_gradient_all_reduce_on_accumulation_micro_batches(monkeypatch, tmp_path):
    w = _wrapped(FakeDDP)
    _train(monkeypatch, tmp_path, w)
    inside = [True] * (GRAD_ACCUM - 1) + [False]  # no_sync on all but each step's last micro-batch
    assert w.model.forwards == inside * STEPS
    assert w.model.backwards == inside * STEPS
