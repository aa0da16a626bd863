"""What this machine can do, found out once per process: the CPU and its vector features, bf16, threads.

    resolve_dtype(requested, device) -> (torch.dtype, reason)   `auto` picks bf16 only where it is fast
    use_threads() -> (threads, why)                            torch.set_num_threads(procenv.thread_count())
    flush_denormals() -> bool                                  subnormal floats computed as zero (fast on x86)
    machine_info() -> dict                                     what reports and benchmarks write beside figures

`auto`: bf16 on a CUDA device that supports it natively (torch.cuda.is_bf16_supported), bf16 on a CPU with
AMX or AVX512_BF16 instructions, fp32 everywhere else: on an AVX2-only CPU a bf16 matmul runs dozens of times
slower than fp32, and on AVX-512 without AVX512_BF16 oneDNN only emulates it. The rule reads capability only,
never a timing: every rank of a job, and every run on the same kind of machine, decides the same, so what
`auto` chose (and why) can go into a manifest or a resume key. (Measured, 2-core AMD EPYC Zen 5 with
AVX512_BF16 and no AMX: bf16 matmul 3.3x and 3.9x faster than fp32 in two runs; a timed rule wrote the two
figures into two manifests that then differed.) An explicit bf16 where it is slow still runs, with one warning
that says how much slower it measured. Each decision is made once per process and logged once (logger
draftsmith.core.machine: one line, at INFO; the CLI shows it).

What must act before torch is imported (the OpenMP wait policy) and what needs no torch (cores, the launch's
process counts) is in draftsmith.core.procenv, standard library only; this module adds what needs torch.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import time
from dataclasses import dataclass
from typing import Optional

import torch

from . import DraftsmithError, procenv

log = logging.getLogger(__name__)

# /proc/cpuinfo flags that decide bf16 matmul speed, weakest first
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
VECTOR_NAMES = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX512_BF16", "amx_bf16": "AMX"}
NAME_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
PROBE_SIZE = 256  # n of the n x n x n matmul the bf16 probe times


@dataclass(frozen=True)
class CpuFeatures:
    model: str  # /proc/cpuinfo's model name
    flags: tuple[str, ...]  # the VECTOR_FLAGS this CPU has
    torch_capability: str  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512
    mkldnn_bf16: bool  # torch.ops.mkldnn._is_mkldnn_bf16_supported(): oneDNN runs bf16 on this CPU
    onednn_max_isa: Optional[str] = None  # ONEDNN_MAX_CPU_ISA when it caps oneDNN (AVX2, AVX512_CORE, ...)

    @property
    def amx(self) -> bool:
        return "amx_bf16" in self.flags and (self.onednn_max_isa is None or "AMX" in self.onednn_max_isa)

    @property
    def native_bf16(self) -> bool:
        """oneDNN runs bf16 matmuls in hardware (AVX-512 or better), not in a slow fallback."""
        capped = self.onednn_max_isa is not None and not self.onednn_max_isa.startswith(("AVX512", "AVX10"))
        return self.mkldnn_bf16 and not capped

    @property
    def vector(self) -> str:
        """The strongest vector feature oneDNN may use: AMX, AVX512_BF16, AVX-512, AVX2 (else torch's word)."""
        cap = self.onednn_max_isa
        usable = [f for f in self.flags if cap is None or (f == "avx2" or (
            cap.startswith(("AVX512", "AVX10")) and (f != "amx_bf16" or "AMX" in cap)))]
        return VECTOR_NAMES[usable[-1]] if usable else self.torch_capability

    @property
    def label(self) -> str:
        """`AMD EPYC 7B13, AVX2`: the model and its vector feature (and a oneDNN cap, if any)."""
        cap = f", ONEDNN_MAX_CPU_ISA={self.onednn_max_isa}" if self.onednn_max_isa else ""
        return f"{self.model}, {self.vector}{cap}"


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo; (platform's word, no flags) where there is none."""
    model = ""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def _mkldnn_bf16() -> bool:
    """torch's own test: oneDNN runs bf16 on this CPU (x86: AVX-512 core or better; arm: the bf16 extension)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN's op
        return False


@functools.cache
def cpu_features() -> CpuFeatures:
    """This CPU, read once per process."""
    model, flags = _cpuinfo()
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return CpuFeatures(model=model, flags=tuple(f for f in VECTOR_FLAGS if f in flags),
                       torch_capability=torch.backends.cpu.get_cpu_capability(),
                       mkldnn_bf16=_mkldnn_bf16(),
                       onednn_max_isa=cap if cap not in ("", "ALL", "DEFAULT") else None)


def _best_seconds(dtype: torch.dtype, n: int, budget_s: float) -> float:
    """Fastest of a few n x n x n matmuls in `dtype` after one warm-up, within about budget_s (at least one timed)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen).to(dtype), torch.randn(n, n, generator=gen).to(dtype)
    end = time.perf_counter() + budget_s
    torch.mm(a, b)
    best = float("inf")
    for _ in range(50):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() >= end:
            break
    return best


@functools.cache
def bf16_probe(n: int = PROBE_SIZE, budget_s: float = 0.2) -> dict:
    """Time an n x n x n matmul in fp32 and in bf16 on this CPU (about budget_s in all, once per process).

    slowdown = bf16 seconds / fp32 seconds (above 1: bf16 is slower)."""
    fp32 = _best_seconds(torch.float32, n, budget_s / 2)
    bf16 = _best_seconds(torch.bfloat16, n, budget_s / 2)
    return {"n": n, "float32_s": fp32, "bfloat16_s": bf16, "slowdown": bf16 / fp32 if fp32 > 0 else float("inf"),
            "threads": torch.get_num_threads()}


def _times(slowdown: float) -> str:
    """`90x slower` / `1.8x faster` (bf16 against fp32)."""
    if slowdown >= 1:
        return f"{slowdown:.0f}x slower" if slowdown >= 10 else f"{slowdown:.1f}x slower"
    return f"{1 / slowdown:.1f}x faster"


def as_torch_dtype(requested) -> Optional[torch.dtype]:
    """None for `auto`; a torch dtype for a torch dtype or its name (float32, bfloat16, fp32, bf16, ...)."""
    if isinstance(requested, torch.dtype):
        return requested
    name = NAME_ALIASES.get(str(requested), str(requested))
    if name == "auto":
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise DraftsmithError(f"dtype {requested!r} is not auto nor a torch dtype (float32, bfloat16, float16, ...).")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_dtype(requested, device="cpu") -> tuple[torch.dtype, str]:
    """(the dtype to compute in on `device`, why). `requested`: auto, a torch dtype, or its name.

    Decided once per process for each (requested, device) and logged once: `auto`'s choice at INFO, an
    explicit bf16 where it is slow as one warning."""
    return _decide(as_torch_dtype(requested), str(torch.device(device)))


@functools.cache
def _decide(requested: Optional[torch.dtype], device: str) -> tuple[torch.dtype, str]:
    """resolve_dtype, cached: logs the choice of `auto` and the warning of a slow explicit bf16 once."""
    if requested is not None and requested != torch.bfloat16:
        return requested, "as requested"
    kind = torch.device(device).type
    if kind == "cpu" or (kind == "cuda" and torch.cuda.is_available()):
        bf16, reason = _bf16_verdict(device)
    else:
        bf16, reason = False, f"{device}: auto picks bf16 only on CUDA and on CPUs with native bf16 matmul"
    if requested is None:
        dtype = torch.bfloat16 if bf16 else torch.float32
        log.info(f"dtype auto -> {dtype_name(dtype)}: {reason}")
        return dtype, reason
    if not bf16 and kind == "cpu":
        where = f"this CPU ({cpu_features().label}): bf16 matmul measured {_times(bf16_probe()['slowdown'])} than fp32 here"
    elif not bf16 and kind == "cuda" and torch.cuda.is_available():
        where = f"{device} ({torch.cuda.get_device_name(torch.device(device))}), which only emulates bf16"
    else:
        return requested, "as requested"
    log.warning(f"warning: dtype bfloat16 (as requested) on {where}; dtype auto would pick float32.")
    return requested, "as requested"


def _bf16_verdict(device: str) -> tuple[bool, str]:
    """(bf16 is the faster choice on `device`, why), from capability alone (no timing: see the module docstring)."""
    if torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name(torch.device(device))
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{device} ({name}) supports bf16"
        return False, f"{device} ({name}) has no native bf16"
    cpu = cpu_features()
    if not cpu.native_bf16:
        return False, f"this CPU ({cpu.label}) has no native bf16 matmul"
    if cpu.vector in ("AMX", "AVX512_BF16"):
        return True, f"this CPU ({cpu.label}) has native bf16 matmul"
    return False, f"this CPU ({cpu.label}) has AVX-512 but no AVX512_BF16: oneDNN only emulates bf16 matmul"


def forget() -> None:
    """Drop every cached finding, so that the next question is answered afresh.

    Only the tests call it (they mock the hardware, one kind of machine per test); it stays here, not in the tests'
    helpers, because what it clears is this module's own private state (`_decide`'s cache, `_settings`): a helper
    elsewhere would reach into those names, and a cache added here would be missed there."""
    for f in (cpu_features, bf16_probe, _decide):
        f.cache_clear()
    _settings.clear()


# ---- threads ---------------------------------------------------------------------------------

_settings: dict = {}  # what use_threads and flush_denormals set in this process, for machine_info


def use_threads(environ=None) -> tuple[int, str]:
    """torch.set_num_threads to procenv.thread_count(): the user's OMP_NUM_THREADS, else the cores this process
    may use divided among its job's processes on this node. Returns (threads, why)."""
    threads, why = procenv.thread_count(environ)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    _settings.update(threads=threads, why=why)
    return threads, why


def flush_denormals() -> bool:
    """Treat subnormal floats as zero on the CPU (x86 FTZ / DAZ; True where supported), for the whole process.

    Why: arithmetic on subnormal values runs in slow microcode on x86. The demo's EAGLE-3 training recipe with the
    kernels capped at AVX2 ran 0.67 s/step without and 0.38 s/step with it, steps 1-160, same data (2-core Xeon,
    2026-12-01). A subnormal is below 1.2e-38 in fp32: dropping it changes no figure draftsmith reports, and the
    decoder stays lossless (the target-only and speculative runs share the setting)."""
    on = bool(torch.set_flush_denormal(True))
    _settings["flush_denormal"] = on
    return on


# ---- the record ------------------------------------------------------------------------------

def machine_info(device: Optional[str] = None) -> dict:
    """What decides speed here, for reports and benchmark files: CPU, vector features, bf16, threads, device."""
    cpu = cpu_features()
    info = {"cpu": cpu.model, "cpu_vector": cpu.vector, "cpu_flags": list(cpu.flags),
            "torch_cpu_capability": cpu.torch_capability, "mkldnn_bf16": cpu.mkldnn_bf16,
            "native_bf16_matmul": cpu.native_bf16, "amx": cpu.amx, "onednn_max_cpu_isa": cpu.onednn_max_isa,
            "cpu_count": os.cpu_count(), "allowed_cores": procenv.allowed_cores(),
            "threads": torch.get_num_threads(), "threads_why": _settings.get("why") or procenv.thread_count()[1],
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "flush_denormal": _settings.get("flush_denormal"),
            "platform": platform.platform(),
            "torch": torch.__version__}
    if bf16_probe.cache_info().currsize:  # measured in this process: keep the figure
        info["bf16_probe"] = bf16_probe()
    if device is not None:
        info["device"] = str(device)
        if torch.device(device).type == "cuda" and torch.cuda.is_available():
            dev = torch.device(device)
            info["gpu"] = torch.cuda.get_device_name(dev)
            info["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(dev)))
    return info
