"""This process's place on the machine: the cores it may use, the processes launched beside it, how OpenMP waits.

Standard library only, because part of it must act before torch is imported: the OpenMP runtime torch loads
(libgomp, or Intel's libiomp) reads its wait policy from the environment when it is loaded, so
`share_cores()` runs at the very start of the CLI, before anything imports torch. draftsmith.core.machine (what
the hardware can do: bf16, threads applied, machine_info) builds on it.

    share_cores()          GOMP_SPINCOUNT=10000 (and KMP_BLOCKTIME=1) unless the user set how OpenMP waits
    thread_count()         (threads, why): the user's OMP_NUM_THREADS, else allowed cores / local processes
    launched_processes()   (processes, why): WORLD_SIZE (torchrun, deepspeed), an srun step's tasks, else 1
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping, Optional

READ = object()  # thread_count(parent=READ): read the launcher's environment from /proc

# Idle OpenMP threads spin briefly, then sleep. libgomp's default (no policy set) spins 300 000 times before
# sleeping, so two processes sharing cores (ranks of one job, or a run beside another) burn each other's cores
# between parallel regions; OMP_WAIT_POLICY=PASSIVE (spin 0) fixes that but makes every small op of a
# batch-1 decode step wait for threads to wake up. Measured on a 2-core Xeon (AMX), 2026-12-01
# (benchmarks/bench_sharing.py, benchmarks/bench_decoder.py): two SmolLM2 data-gens at once took 3.23x one alone with
# the default spin, 1.14x with PASSIVE, 1.80x with 10 000 (2.0 = the cores shared fairly); one fp32 decode
# 31.4 tok/s with the default, 18.0 with PASSIVE, 30.6 with 10 000. KMP_BLOCKTIME (ms) is the same knob for
# Intel's OpenMP runtime.
SHORT_SPIN_ENV = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}


def share_cores(environ: Optional[MutableMapping[str, str]] = None) -> dict[str, str]:
    """Set a short OpenMP spin in `environ` (os.environ) where the user set none; returns what it set.

    Call before torch is imported (the OpenMP runtime reads these when it is loaded); a user's own
    OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME wins."""
    environ = os.environ if environ is None else environ
    if any(k in environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):  # the user chose how libgomp waits
        return {}
    added = {k: v for k, v in SHORT_SPIN_ENV.items() if k not in environ}
    environ.update(added)
    return added


def allowed_cores() -> int:
    """Cores this process may run on (its CPU affinity: taskset, cgroups, SLURM binding), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def local_processes(environ: Mapping[str, str]) -> tuple[int, str]:
    """(processes of this job on this node, the variable that says so): torchrun's LOCAL_WORLD_SIZE,
    the DeepSpeed launcher's LOCAL_SIZE, else 1."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = _int(environ.get(key))
        if value is not None and value >= 1:
            return value, key
    return 1, ""


def parent_environ() -> Optional[dict[str, str]]:
    """The environment the parent process started with (/proc/<ppid>/environ), or None where unreadable."""
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def user_omp_threads(environ: Mapping[str, str], parent: Optional[Mapping[str, str]]) -> Optional[int]:
    """OMP_NUM_THREADS as the user set it, or None.

    torchrun sets OMP_NUM_THREADS=1 for its workers when the user set none (a default meant for GPU jobs);
    that one is not the user's: a torchrun worker (TORCHELASTIC_RUN_ID) whose launcher started without
    OMP_NUM_THREADS ignores it. Where the launcher's environment cannot be read, the value is respected."""
    value = environ.get("OMP_NUM_THREADS")
    threads = _int(value.split(",")[0]) if value else None
    if threads is None or threads < 1:
        return None
    if "TORCHELASTIC_RUN_ID" in environ and parent is not None and "OMP_NUM_THREADS" not in parent:
        return None
    return threads


def thread_count(environ: Optional[Mapping[str, str]] = None, cores: Optional[int] = None,
                 parent=READ) -> tuple[int, str]:
    """(intra-op threads for this process, why): the user's OMP_NUM_THREADS, else the cores this process may
    use divided among the processes of its job on this node (at least 1). `parent`: the launcher's environment
    (None: unknown); by default read from /proc."""
    environ = os.environ if environ is None else environ
    cores = allowed_cores() if cores is None else cores
    parent = parent_environ() if parent is READ else parent
    user = user_omp_threads(environ, parent)
    if user is not None:
        return user, f"OMP_NUM_THREADS={user}"
    local, key = local_processes(environ)
    if local > 1:
        return max(1, cores // local), f"{cores} allowed cores / {key}={local}"
    return max(1, cores), f"{cores} allowed cores"


def launched_processes(environ: Optional[Mapping[str, str]] = None) -> tuple[int, str]:
    """(processes of this job, the variable that says so): WORLD_SIZE (torchrun, the DeepSpeed launcher),
    else the tasks of an srun step (SLURM_STEP_NUM_TASKS, or SLURM_NTASKS inside a step), else 1."""
    environ = os.environ if environ is None else environ
    world = _int(environ.get("WORLD_SIZE"))
    if world is not None:
        return max(world, 1), "WORLD_SIZE"
    if "SLURM_STEP_ID" in environ:  # inside srun (an sbatch script alone is no step: its SLURM_NTASKS is the job's)
        for key in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
            tasks = _int(environ.get(key))
            if tasks is not None:
                return max(tasks, 1), key
    return 1, ""


def _int(value) -> Optional[int]:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return None
