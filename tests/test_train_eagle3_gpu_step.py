"""The GPU-grade EAGLE-3 step (issue 46), checked in float64 on the CPU: the memory-efficient attention (flex) equals
the dense one, a packed micro-batch equals its conversations one by one, the loss does not depend on its chunk, the
device path has no host sync and equals the CPU path, activation checkpointing keeps the gradients. Each check is
shown to fail on a deliberately broken step (a mask or a target reaching across documents, a host sync)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from draftsmith.core import DraftsmithError
from draftsmith.train import eagle3
from draftsmith.train.eagle3 import (ATTENTION, Eagle3Config, Eagle3Step, attention_for, check_attention_against_dense,
                                     eagle3_loss, flex_step0_mask, loss_chunk_rows, pack, random_conversation,
                                     tiny_eagle3_head, ttt_hidden, ttt_spans)

# flex_attention on the CPU runs eagerly (its reference implementation), and says so
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

STEPS = 3
LENGTHS = (9, 14, 5, 11, 7)  # five conversations
ROWS = [[0, 1], [3, 2, 4]]  # packed two rows of T = 30: 23 and 23 tokens, then padding; each row opens with a prompt
T = 30
NORMS = {"plain": {}, "all_norms": {"norm_before_fc": True, "fc_norm": True, "norm_output": True}}


@pytest.fixture(autouse=True)
def float64_rms_norms(monkeypatch):
    """transformers' LlamaRMSNorm computes in float32 whatever its input: in float64 here, so that the paths compared
    agree to float64 rounding, not float32's (as tests/test_train_speed.py)."""
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)


def _setup(norms="plain"):
    head = tiny_eagle3_head(**NORMS[norms])
    g = torch.Generator().manual_seed(1)
    conversations = [random_conversation(head, n, g) for n in LENGTHS]
    for c in (1, 2, 4):  # no prompt: the loss from the first token on, so a target from across a boundary would count
        conversations[c]["loss_mask"][:] = 1
    return head, conversations


def _run(head, batch, grads=True, **options):
    """(loss, stats, gradients of every trainable parameter: zeros where none flowed) of one step."""
    head.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grads):
        loss, stats = eagle3_loss(head, **batch, steps=STEPS, **options)
    if grads:
        loss.backward()
    return loss.detach(), stats, {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                                  for n, p in head.named_parameters() if p.requires_grad}


def _assert_same(a, b, rtol=1e-10, stats_rtol=1e-6):
    """Two `_run` results agree: loss and gradients to float64 rounding, statistics (float32) to theirs."""
    torch.testing.assert_close(a[0], b[0], rtol=rtol, atol=1e-12)
    torch.testing.assert_close(a[1], b[1], rtol=stats_rtol, atol=1e-4)
    for n in a[2]:
        torch.testing.assert_close(a[2][n], b[2][n], rtol=1e-8, atol=1e-11, msg=n)


# ---- flex attention equals the dense one ------------------------------------------------------------------------

def _hidden(head, batch, attention, spans=None):
    with torch.no_grad():
        return list(ttt_hidden(head, batch["input_ids"], head.fuse(batch["aux"]), batch["attention_mask"], STEPS, spans,
                               batch.get("position_ids"), batch.get("document_ids"), attention))


@pytest.mark.parametrize("norms", list(NORMS))
@pytest.mark.parametrize("sync_free", [False, True], ids=["cpu_path", "device_path"])
def test_flex_attention_equals_dense(sync_free, norms):
    """Every step's hidden (padding included) and the loss and statistics, packed; the CPU path's ranges start past
    the prompts (flex's block mask then sees its queries shifted by lo)."""
    head, conversations = _setup(norms)
    batch = pack(conversations, ROWS, T)
    batch["loss_mask"][:, :5] = 0  # a longer prompt in each row's first conversation: the ranges start past index 0
    valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    spans = None if sync_free else ttt_spans(valid, STEPS, batch["document_ids"])
    assert sync_free or spans[0][0] > 0
    for dense, flex in zip(_hidden(head, batch, "dense", spans), _hidden(head, batch, "flex", spans)):
        torch.testing.assert_close(flex, dense, rtol=1e-10, atol=1e-10)
    _assert_same(_run(head, batch, grads=False, attention="flex", sync_free=sync_free),
                 _run(head, batch, grads=False, attention="dense", sync_free=sync_free))


def test_flex_mask_across_documents_is_caught(monkeypatch):
    """A flex mask that lets attention cross documents fails the comparison above."""
    head, conversations = _setup()
    batch = pack(conversations, ROWS, T)
    monkeypatch.setitem(ATTENTION, "flex", (lambda am, documents, end: flex_step0_mask(am, None, end),
                                            ATTENTION["flex"][1]))
    dense, flex = _hidden(head, batch, "dense"), _hidden(head, batch, "flex")
    real = batch["attention_mask"].bool()
    assert (flex[0][real] - dense[0][real]).abs().max() > 1e-3


def test_the_gpu_checks_function_on_the_cpu():
    """`check_attention_against_dense`, which benchmarks/gpu_train_check.py runs on CUDA with gradients: values
    here (flex has no backward on the CPU: asking for gradients there is torch's error)."""
    for scale in (1, 10):  # T = 30 and 300: one of flex's blocks, and three (whole blocks skipped)
        diffs = check_attention_against_dense("cpu", torch.float64, grads=False, steps=Eagle3Config.ttt_steps,
                                              scale=scale)
        assert diffs["loss"] < 1e-10 and diffs["stats"] < 1e-4 and diffs["grad"] == 0.0
    with pytest.raises(RuntimeError, match="backward on CPU"):
        check_attention_against_dense("cpu", torch.float64, grads=True, steps=Eagle3Config.ttt_steps)


# ---- packing -----------------------------------------------------------------------------------------------------

def _one_by_one(head, conversations, **options):
    """The summed loss, statistics and gradients of each conversation alone (a row of its own length), added up."""
    runs = [_run(head, pack([c], [[0]], c["input_ids"].shape[0], documents=False), reduction="sum", **options)
            for c in conversations]
    return (sum(r[0] for r in runs), sum(r[1] for r in runs), {n: sum(r[2][n] for r in runs) for n in runs[0][2]})


@pytest.mark.parametrize("norms", list(NORMS))
@pytest.mark.parametrize("sync_free", [False, True], ids=["cpu_path", "device_path"])
def test_packed_equals_one_by_one(sync_free, norms):
    """The summed loss (sum over steps i and counted rows of decay^i * soft-CE), every gradient and the summed
    statistics of a packed micro-batch equal those of its conversations one by one."""
    head, conversations = _setup(norms)
    packed = _run(head, pack(conversations, ROWS, T), reduction="sum", sync_free=sync_free)
    _assert_same(packed, _one_by_one(head, conversations, sync_free=sync_free), stats_rtol=1e-5)


def _without_targets_check(valid, k, document_ids=None):
    return COUNTED(valid, k, None)


COUNTED = eagle3.counted_targets


@pytest.mark.parametrize("broken", ["attention_crosses_documents", "targets_cross_documents"])
def test_packing_check_catches_a_missing_boundary(broken, monkeypatch):
    """The comparison above fails when attention crosses documents or a TTT target is taken from the next
    conversation."""
    head, conversations = _setup()
    batch = pack(conversations, ROWS, T)
    if broken == "targets_cross_documents":
        monkeypatch.setattr(eagle3, "counted_targets", _without_targets_check)
    else:
        del batch["document_ids"]
    loss = _run(head, batch, reduction="sum", sync_free=True)[0]
    assert abs(loss - _one_by_one(head, conversations, sync_free=True)[0]) > 1e-3


def test_positions_restart_per_document():
    """Step i at index t sits at position_ids[t] + i. (Rotary attention reads only the distance between query and
    key, so positions that ran on across a packed row would change the loss by the rotary tables' float32 rounding
    alone: checked here where they are made, not through the loss.)"""
    head, conversations = _setup()
    batch = pack(conversations, ROWS, T)
    seen = []
    rotary = head.rotary_emb.forward
    head.rotary_emb.forward = lambda x, positions: seen.append(positions) or rotary(x, positions)
    _hidden(head, batch, "dense")
    expected = batch["position_ids"][:, None, :] + torch.arange(STEPS)[:, None]  # (B, steps, T)
    assert len(seen) == 1 and torch.equal(seen[0], expected.flatten(1))


def test_mean_and_summed_loss():
    """reduction=mean (training) is sum_i decay^i * (summed step-i loss / its loss rows); reduction=sum the summed
    loss; both read off the statistics' columns loss_i * n_loss and n_loss."""
    head, conversations = _setup()
    batch = pack(conversations, ROWS, T)
    mean, stats, _ = _run(head, batch, grads=False)
    summed = _run(head, batch, grads=False, reduction="sum")[0]
    decay = torch.tensor([0.8 ** i for i in range(STEPS)], dtype=torch.float64)
    ce_sum, n_loss = stats[:, 0].double(), stats[:, 1].double()
    assert (n_loss > 0).all()
    torch.testing.assert_close(mean, (decay * ce_sum / n_loss).sum(), rtol=1e-6, atol=0)
    torch.testing.assert_close(summed, (decay * ce_sum).sum(), rtol=1e-6, atol=0)


# ---- the loss chunk ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sync_free", [False, True], ids=["cpu_path", "device_path"])
def test_loss_does_not_depend_on_the_chunk(sync_free):
    head, conversations = _setup()
    batch = pack(conversations, ROWS, T)
    ref = _run(head, batch, sync_free=sync_free, loss_chunk=32)
    for chunk in (1, 7, 10 ** 6):
        _assert_same(_run(head, batch, sync_free=sync_free, loss_chunk=chunk), ref, rtol=1e-12, stats_rtol=1e-6)


def test_loss_chunk_is_sized_for_the_device():
    assert loss_chunk_rows(torch.device("cpu"), 32000) == 32
    cuda = torch.device("cuda")  # a device name only: no GPU is touched
    assert loss_chunk_rows(cuda, 32000) == eagle3.LOSS_CHUNK_BYTES // (12 * 32000) > 1000
    assert loss_chunk_rows(cuda, 128256) < loss_chunk_rows(cuda, 32000)


# ---- host syncs ----------------------------------------------------------------------------------------------------

class HostSyncs(TorchFunctionMode):
    """Records the torch calls that wait for the device: reading a value on the host, or a shape that depends on
    values (nonzero, a bool-mask index)."""

    NAMES = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
             "argwhere", "masked_select", "unique", "unique_consecutive"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        indices = args[1] if len(args) > 1 and name in ("__getitem__", "__setitem__", "index_put", "index_put_") else ()
        indices = indices if isinstance(indices, (tuple, list)) else (indices,)
        if (name in self.NAMES or (name == "where" and len(args) == 1)
                or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("norms", list(NORMS))
def test_device_path_has_no_host_sync(norms):
    """Forward and backward of the device path (packed) make no host sync; the CPU path makes several (the counter
    sees them)."""
    head, conversations = _setup(norms)
    batch = pack(conversations, ROWS, T)
    for sync_free in (True, False):
        with HostSyncs() as syncs:
            loss, _ = eagle3_loss(head, **batch, steps=STEPS, sync_free=sync_free)
            loss.backward()
        if sync_free:
            assert syncs.calls == []
        else:
            assert {"nonzero", "__int__"} <= set(syncs.calls)


@pytest.mark.parametrize("norms", list(NORMS))
@pytest.mark.parametrize("packed", [False, True])
def test_device_path_equals_cpu_path(packed, norms):
    head, conversations = _setup(norms)
    batch = pack(conversations, ROWS, T) if packed else pack(conversations, [[1], [3]], 16, documents=False)
    _assert_same(_run(head, batch, sync_free=True), _run(head, batch, sync_free=False))


def test_default_path_follows_the_device(monkeypatch):
    """eagle3_loss picks the CPU path on the CPU (sync_free unset)."""
    head, conversations = _setup()
    batch = pack(conversations, ROWS, T)
    paths = []
    monkeypatch.setattr(eagle3, "ttt_spans", lambda *a: paths.append("spans") or COUNTED_SPANS(*a))
    eagle3_loss(head, **batch, steps=STEPS)
    assert paths == ["spans"]


COUNTED_SPANS = eagle3.ttt_spans


# ---- activation checkpointing --------------------------------------------------------------------------------------

@pytest.mark.parametrize("sync_free", [False, True], ids=["cpu_path", "device_path"])
def test_activation_checkpointing_keeps_the_gradients(sync_free, monkeypatch):
    """Each TTT step's layer runs again in backward (checkpointed), and loss, statistics and gradients are equal."""
    head, conversations = _setup("all_norms")
    batch = pack(conversations, ROWS, T)
    calls = []
    step = eagle3.ttt_step
    monkeypatch.setattr(eagle3, "ttt_step", lambda *a: calls.append(a[1]) or step(*a))
    plain = _run(head, batch, sync_free=sync_free)
    assert calls == list(range(STEPS))
    calls.clear()
    checkpointed = _run(head, batch, sync_free=sync_free, activation_checkpointing=True)
    assert sorted(calls) == sorted(list(range(STEPS)) * 2)  # forward, then the recompute in backward
    _assert_same(checkpointed, plain, rtol=1e-12)


# ---- options -------------------------------------------------------------------------------------------------------

def test_attention_option():
    assert Eagle3Config().attention == "auto" and not Eagle3Config().activation_checkpointing
    with pytest.raises(DraftsmithError, match="method.attention"):
        Eagle3Config(attention="sdpa")
    assert attention_for("auto", torch.device("cpu")) == "dense"
    assert attention_for("auto", torch.device("cuda")) == "flex"
    assert attention_for("dense", torch.device("cuda")) == "dense"


def test_step_module_passes_packing_and_options_through():
    head, conversations = _setup()
    batch = pack(conversations, ROWS, T)
    module = Eagle3Step(head, STEPS, 0.8, attention="dense", activation_checkpointing=True)
    loss, stats = module(**batch)
    ref_loss, ref_stats = eagle3_loss(head, **batch, steps=STEPS)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(stats, ref_stats)


@pytest.mark.parametrize("stored", [False, True])
def test_target_side_without_host_sync_equals_the_gathered_one(stored):
    """prepare's target side (train/features.py TargetHead) on the device path: every position computed and the
    uncounted ones zeroed, with no host sync, equals the CPU path's gather of the counted rows (which syncs)."""
    from draftsmith.train.features import TargetHead

    g = torch.Generator().manual_seed(3)
    V, H = 50, 8
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:20]] = True
    head = TargetHead(torch.randn(V, H, generator=g, dtype=torch.float64), t2d)
    last = torch.randn(2, 9, H, generator=g, dtype=torch.float64)
    rows = torch.rand(2, 9, generator=g) > 0.4
    logits = last @ torch.randn(V, H, generator=g, dtype=torch.float64).T
    extra = (logits.argmax(-1), torch.logsumexp(logits, -1)) if stored else ()
    with HostSyncs() as syncs:
        free = head(last, rows, *extra, sync_free=True)
    assert syncs.calls == []
    with HostSyncs() as syncs:
        gathered = head(last, rows, *extra, sync_free=False)
    assert syncs.calls  # the gather syncs: the counter sees it
    for a, b in zip((free.probs, free.in_mass, free.argmax, free.argmax_in_draft),
                    (gathered.probs, gathered.in_mass, gathered.argmax, gathered.argmax_in_draft)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)  # float64 (ints and bools: exactly)
