"""The process group and the collectives run on it: every torch.distributed call of the stages goes through here.

    backend_for(device) -> str       "cpu:gloo,cuda:nccl" for a GPU, "gloo" otherwise
    init_group(device, world)        takes this process's GPU, then creates the group (unless one exists)
    collective_device() -> device    where the group reduces: this process's GPU when the group has NCCL, else the CPU
    all_reduce(t) -> tensor          the sum over the ranks, handed back on t's device (t itself without a group)
    barrier(), close()               wait for every rank; tear the group down

NCCL reduces CUDA tensors only ("No backend type associated with device type cpu", even alone), so a GPU run's
group pairs gloo for CPU tensors with NCCL for CUDA ones: a stray CPU collective still runs. The helpers hand NCCL
its tensors on the GPU, so a training step's record stays on the device until its one host read.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str) -> str:
    """The group's backend for a run on `device`: gloo serves CPU tensors, NCCL CUDA ones."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def init_group(device: str, world: int) -> None:
    """Take this process's GPU (device's index, else LOCAL_RANK), then create the default group unless one exists:
    from the launcher's env:// variables, or alone (world 1) a private one on a free port."""
    dev = torch.device(device)
    if dev.type == "cuda":
        # NCCL works on the current GPU: without this every rank of a node would start on cuda:0.
        torch.cuda.set_device(dev.index if dev.index is not None else int(os.environ.get("LOCAL_RANK", "0")))
    if dist.is_initialized():
        return
    if world == 1:
        dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    else:
        dist.init_process_group(backend_for(device))


def collective_device() -> torch.device:
    """Where the group's collectives run: the current GPU when the group has NCCL, else the CPU."""
    if "nccl" in dist.get_backend():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """The sum of `t` over the group's ranks, on t's device (reduced in place when t already lies on the group's
    device); `t` itself when no group exists."""
    if not dist.is_initialized():
        return t
    on_group = t.to(collective_device())
    dist.all_reduce(on_group)
    return on_group.to(t.device)


def barrier() -> None:
    """Wait until every rank gets here (nothing to wait for without a group)."""
    if dist.is_initialized():
        dist.barrier()


def close() -> None:
    """Tear the group down once every rank is done (gloo ranks otherwise wait for each other at exit)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
