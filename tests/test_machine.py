"""draftsmith.core.machine / draftsmith.core.procenv: `auto` dtype and precision by measured capability (every kind of
machine mocked), the one warning of an explicit bf16 where it is slow, deepspeed=auto, threads that survive
sharing, and the stages' new defaults."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from draftsmith.core import DraftsmithError, machine, procenv
from draftsmith.configs import compose
from draftsmith.core.machine import CpuFeatures
from draftsmith.train.trainer import resolve_deepspeed, resolve_precision

AMX = CpuFeatures("Intel(R) Xeon(R) Platinum 8480+", ("avx2", "avx512f", "avx512_bf16", "amx_bf16"), "AVX512", True)
AVX2 = CpuFeatures("AMD EPYC 7B13 64-Core Processor", ("avx2",), "AVX2", False)
ZEN4 = CpuFeatures("AMD EPYC 9654 96-Core Processor", ("avx2", "avx512f", "avx512_bf16"), "AVX512", True)


@pytest.fixture(autouse=True)
def fresh_machine():
    machine.forget()
    yield
    machine.forget()


def on_cpu(monkeypatch, cpu: CpuFeatures, slowdown=None):
    """Pretend to run on `cpu`; the bf16 probe reports `slowdown` (bf16 s / fp32 s), or must not run."""
    monkeypatch.setattr(machine, "cpu_features", lambda: cpu)

    def probe():
        if slowdown is None:
            raise AssertionError("the bf16 probe ran where capability alone decides")
        return {"n": 256, "float32_s": 1.0, "bfloat16_s": slowdown, "slowdown": slowdown, "threads": 1}

    probe.cache_info = lambda: type("I", (), {"currsize": int(slowdown is not None)})()
    monkeypatch.setattr(machine, "bf16_probe", probe)


def on_cuda(monkeypatch, bf16: bool, name="NVIDIA H200"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


# ---- auto, by capability -------------------------------------------------------------------

def test_auto_on_cuda_with_bf16(monkeypatch):
    on_cuda(monkeypatch, True)
    assert machine.resolve_dtype("auto", "cuda:0") == (torch.bfloat16, "cuda:0 (NVIDIA H200) supports bf16")
    assert resolve_precision("auto", "cuda:0")[0] == "bf16"


def test_auto_on_cuda_without_bf16(monkeypatch):
    on_cuda(monkeypatch, False, "Tesla V100-SXM2-16GB")
    dtype, why = machine.resolve_dtype("auto", "cuda:0")
    assert dtype == torch.float32 and why == "cuda:0 (Tesla V100-SXM2-16GB) has no native bf16"
    assert resolve_precision("auto", "cuda:0")[0] == "fp32"


def test_auto_on_a_cpu_with_amx(monkeypatch):
    on_cpu(monkeypatch, AMX)  # no probe: AMX is fast bf16
    assert machine.resolve_dtype("auto", "cpu") == (
        torch.bfloat16, "this CPU (Intel(R) Xeon(R) Platinum 8480+, AMX) has native bf16 matmul")
    assert resolve_precision("auto", "cpu") == ("bf16", machine.resolve_dtype("auto", "cpu")[1])


def test_auto_on_a_cpu_without_native_bf16(monkeypatch, caplog):
    on_cpu(monkeypatch, AVX2)  # no probe either: nothing to measure for auto
    with caplog.at_level(logging.INFO, logger="draftsmith.core.machine"):
        for _ in range(3):
            dtype, why = machine.resolve_dtype("auto", "cpu")
    assert dtype == torch.float32 and why == "this CPU (AMD EPYC 7B13 64-Core Processor, AVX2) has no native bf16 matmul"
    assert resolve_precision("auto", "cpu")[0] == "fp32"
    # decided once per process, said once
    assert caplog.messages == ["dtype auto -> float32: this CPU (AMD EPYC 7B13 64-Core Processor, AVX2) has no "
                               "native bf16 matmul"]


def test_auto_on_a_cpu_with_avx512_bf16_but_no_amx_reads_capability_not_a_timing(monkeypatch):
    # Zen 4/5: AVX512_BF16 without AMX. The old rule timed a matmul and wrote "3.3x" / "3.9x faster" into two
    # manifests of the same job; the rule reads capability only, so the probe must not run at all
    on_cpu(monkeypatch, ZEN4)
    monkeypatch.setattr(machine, "bf16_probe", lambda *a: pytest.fail("dtype auto timed bf16"))
    assert machine.resolve_dtype("auto", "cpu") == (
        torch.bfloat16, "this CPU (AMD EPYC 9654 96-Core Processor, AVX512_BF16) has native bf16 matmul")


def test_auto_on_avx512_without_avx512_bf16_is_fp32(monkeypatch):
    skylake = CpuFeatures("Intel(R) Xeon(R) Gold 6148", ("avx2", "avx512f"), "AVX512", True)
    on_cpu(monkeypatch, skylake)
    assert machine.resolve_dtype("auto", "cpu") == (
        torch.float32, "this CPU (Intel(R) Xeon(R) Gold 6148, AVX-512) has AVX-512 but no AVX512_BF16: oneDNN only "
                       "emulates bf16 matmul")


def test_two_auto_runs_on_a_bf16_cpu_without_amx_write_equal_manifests(monkeypatch):
    """What data-gen writes of `auto` (target_dtype's dtype and why) is the same in two runs whatever a bf16
    timing would have said: nothing timed identifies an output."""
    from draftsmith.data_gen.target import TargetConfig, resolved_target

    records = []
    for fake_seconds in (1 / 3.3, 1 / 3.9):  # the two figures the old rule wrote on Zen 5
        machine._decide.cache_clear()  # a new process: nothing decided yet
        on_cpu(monkeypatch, ZEN4, fake_seconds)
        requested = TargetConfig(name="tiny", dtype="auto")
        cfg, why = resolved_target(requested)
        records.append({"dtype": cfg.dtype, "why": why})
        assert requested.dtype == "auto"  # resolved into a new config, the requested one untouched
    assert records[0] == records[1] and records[0]["dtype"] == "bfloat16"


def test_the_ranks_of_one_job_agree_on_auto():
    """Two processes of one job (as torchrun starts them) each decide `auto` on their own: with a rule of capability
    alone their choice and reason are the same, even with the other rank busy (a timing would be skewed)."""
    code = textwrap.dedent("""
        import json, sys
        from draftsmith.core import machine
        dtype, why = machine.resolve_dtype("auto", "cpu")
        print(json.dumps([machine.dtype_name(dtype), why]))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "PYTHONWARNINGS": "ignore"})
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert outs[0][0] == outs[1][0] and outs[0][0].strip()


def test_a_onednn_isa_cap_below_avx512_means_no_native_bf16(monkeypatch):
    capped = CpuFeatures(AMX.model, AMX.flags, "AVX512", True, onednn_max_isa="AVX2")
    assert not capped.native_bf16 and not capped.amx and capped.vector == "AVX2"
    on_cpu(monkeypatch, capped)
    assert machine.resolve_dtype("auto", "cpu")[0] == torch.float32
    no_amx = CpuFeatures(AMX.model, AMX.flags, "AVX512", True, onednn_max_isa="AVX512_CORE_BF16")
    assert no_amx.native_bf16 and not no_amx.amx and no_amx.vector == "AVX512_BF16"


def test_explicit_dtypes_are_kept(monkeypatch):
    on_cpu(monkeypatch, ZEN4)  # (no probe: only auto and bf16 need to know whether bf16 is fast)
    assert machine.resolve_dtype("float32", "cpu") == (torch.float32, "as requested")
    assert machine.resolve_dtype("fp16", "cpu")[0] == torch.float16
    assert machine.resolve_dtype(torch.float64, "cpu")[0] == torch.float64
    assert resolve_precision("fp32", "cpu")[0] == "fp32" and resolve_precision("fp16", "cpu")[0] == "fp16"
    with pytest.raises(DraftsmithError, match="not auto nor a torch dtype"):
        machine.resolve_dtype("bogus", "cpu")


# ---- explicit bf16 where it is slow ----------------------------------------------------------

def test_explicit_bf16_on_a_cpu_without_native_bf16_runs_with_one_warning(monkeypatch, caplog):
    on_cpu(monkeypatch, AVX2, slowdown=90.4)
    with caplog.at_level(logging.INFO, logger="draftsmith.core.machine"):
        got = [machine.resolve_dtype(name, "cpu") for name in ("bfloat16", "bf16", torch.bfloat16)]
        assert resolve_precision("bf16", "cpu")[0] == "bf16"
    assert {g[0] for g in got} == {torch.bfloat16}
    assert caplog.messages == [
        "warning: dtype bfloat16 (as requested) on this CPU (AMD EPYC 7B13 64-Core Processor, AVX2): bf16 matmul "
        "measured 90x slower than fp32 here; dtype auto would pick float32."]
    assert caplog.records[0].levelno == logging.WARNING


def test_explicit_bf16_on_a_gpu_that_only_emulates_it_warns_once(monkeypatch, caplog):
    on_cuda(monkeypatch, False, "Tesla T4")
    with caplog.at_level(logging.INFO, logger="draftsmith.core.machine"):
        for _ in range(2):
            assert machine.resolve_dtype("bf16", "cuda:1") == (torch.bfloat16, "as requested")
    assert caplog.messages == ["warning: dtype bfloat16 (as requested) on cuda:1 (Tesla T4), which only emulates bf16; "
                               "dtype auto would pick float32."]


def test_explicit_bf16_where_it_is_fast_says_nothing(monkeypatch, caplog):
    on_cpu(monkeypatch, AMX)
    with caplog.at_level(logging.INFO, logger="draftsmith.core.machine"):
        assert machine.resolve_dtype("bfloat16", "cpu") == (torch.bfloat16, "as requested")
    assert caplog.messages == []


def test_the_real_probe_and_machine_info():
    probe = machine.bf16_probe(64, 0.02)
    assert probe["float32_s"] > 0 and probe["bfloat16_s"] > 0 and probe["slowdown"] > 0
    info = machine.machine_info("cpu")
    assert info["cpu"] and info["threads"] == torch.get_num_threads() and info["allowed_cores"] >= 1
    assert set(info["cpu_flags"]) <= set(machine.VECTOR_FLAGS) and isinstance(info["native_bf16_matmul"], bool)
    assert info["device"] == "cpu" and "threads_why" in info


def test_an_avx2_only_cpu_emulated_by_onednn_warns_once_in_a_real_process():
    """ONEDNN_MAX_CPU_ISA=AVX2 caps oneDNN as on an AVX2-only CPU: auto -> float32, an explicit bf16 -> one warning
    with the probe's real figure."""
    code = textwrap.dedent("""
        import logging
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from draftsmith.core import machine
        print(machine.resolve_dtype("auto", "cpu")[0])
        for _ in range(2):
            machine.resolve_dtype("bfloat16", "cpu")
    """)
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch.float32"
    lines = [ln for ln in result.stderr.splitlines() if "dtype" in ln]
    assert lines[0].startswith("dtype auto -> float32: this CPU (") and "ONEDNN_MAX_CPU_ISA=AVX2) has no native bf16" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("warning: dtype bfloat16 (as requested) on this CPU (")
    assert "bf16 matmul measured " in lines[1] and " than fp32 here; dtype auto would pick float32." in lines[1]


# ---- deepspeed=auto ----------------------------------------------------------------------------

@pytest.mark.parametrize("environ,expected", [
    ({}, "none"),
    ({"WORLD_SIZE": "1"}, "none"),
    ({"WORLD_SIZE": "2"}, "zero2"),  # torchrun / the deepspeed launcher
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"}, "zero2"),  # srun -n 4
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "8"}, "zero2"),
    ({"SLURM_NTASKS": "4"}, "none"),  # an sbatch script itself is one process
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "WORLD_SIZE": "1"}, "none"),  # srun + one torchrun worker
])
def test_deepspeed_auto(environ, expected):
    choice, why = resolve_deepspeed("auto", environ)
    assert choice == expected
    assert ("processes" in why) if expected == "zero2" else why == "one process: plain torch, no DeepSpeed"


def test_deepspeed_explicit_is_kept():
    assert resolve_deepspeed("zero3", {"WORLD_SIZE": "8"})[0] == "zero3"
    assert resolve_deepspeed("none", {"WORLD_SIZE": "8"})[0] == "none"
    assert resolve_deepspeed("my/ds.json", {})[0] == "my/ds.json"


# ---- threads ---------------------------------------------------------------------------------

@pytest.mark.parametrize("environ,parent,expected", [
    ({}, None, (16, "16 allowed cores")),
    ({"LOCAL_WORLD_SIZE": "4"}, None, (4, "16 allowed cores / LOCAL_WORLD_SIZE=4")),  # torchrun
    ({"LOCAL_SIZE": "2"}, None, (8, "16 allowed cores / LOCAL_SIZE=2")),  # the deepspeed launcher
    ({"LOCAL_WORLD_SIZE": "32"}, None, (1, "16 allowed cores / LOCAL_WORLD_SIZE=32")),
    ({"OMP_NUM_THREADS": "3", "LOCAL_WORLD_SIZE": "4"}, None, (3, "OMP_NUM_THREADS=3")),  # the user's wins
    # torchrun's own OMP_NUM_THREADS=1 (its launcher had none) is not the user's
    ({"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"}, {},
     (8, "16 allowed cores / LOCAL_WORLD_SIZE=2")),
    ({"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"}, {"OMP_NUM_THREADS": "1"},
     (1, "OMP_NUM_THREADS=1")),
    ({"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"}, None, (1, "OMP_NUM_THREADS=1")),
])
def test_thread_count(environ, parent, expected):
    assert procenv.thread_count(environ, cores=16, parent=parent) == expected


def test_thread_count_reads_the_affinity(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 4, 5, 6, 7}, raising=False)
    assert procenv.allowed_cores() == 6
    assert procenv.thread_count({"LOCAL_WORLD_SIZE": "2"}, parent=None) == (3, "6 allowed cores / LOCAL_WORLD_SIZE=2")


def test_use_threads_sets_torch(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(procenv, "allowed_cores", lambda: 1)
    try:
        assert machine.use_threads({}) == (1, "1 allowed cores")
        assert torch.get_num_threads() == 1 and machine.machine_info()["threads_why"] == "1 allowed cores"
    finally:
        torch.set_num_threads(before)


def test_share_cores_sets_a_short_spin_unless_the_user_chose():
    env: dict = {}
    assert procenv.share_cores(env) == {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"} == env
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert procenv.share_cores(env) == {} and env == {"OMP_WAIT_POLICY": "ACTIVE"}
    env = {"GOMP_SPINCOUNT": "300000"}
    assert procenv.share_cores(env) == {} and env == {"GOMP_SPINCOUNT": "300000"}
    env = {"KMP_BLOCKTIME": "200"}
    procenv.share_cores(env)
    assert env == {"KMP_BLOCKTIME": "200", "GOMP_SPINCOUNT": "10000"}


def test_the_cli_sets_the_wait_policy_before_torch_is_imported():
    code = textwrap.dedent("""
        import os, sys
        from draftsmith.core import procenv
        real = procenv.share_cores
        def spy(*a, **k):
            print("torch imported first:", "torch" in sys.modules)
            return real(*a, **k)
        procenv.share_cores = spy
        from draftsmith.cli import main
        try:
            main(["data-gen", "--help"])
        except SystemExit:
            pass
        print("spin:", os.environ.get("GOMP_SPINCOUNT"))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    result = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONWARNINGS": "ignore"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch imported first: False" in result.stdout and "spin: 10000" in result.stdout


# ---- the stages' defaults ------------------------------------------------------------------------

def test_stage_defaults_are_auto():
    train = compose("train", ["data=/x"])
    assert (train.precision, train.deepspeed.config, train.target.dtype) == ("auto", "auto", "auto")
    assert compose("data_gen").target.dtype == "auto"
    assert compose("eval", ["prompts.path=/x"]).target.dtype == "auto"
    assert compose("data_gen", ["target=hf", "target.name=x/y"]).target.dtype == "auto"
    assert compose("data_gen", ["target.dtype=float32"]).target.dtype == "float32"
    explicit = compose("train", ["data=/x", "precision=bf16", "deepspeed=zero2", "target.dtype=bf16"])
    assert (explicit.precision, explicit.deepspeed.config, explicit.target.dtype) == ("bf16", "zero2", "bf16")


def test_fp16_with_deepspeed_auto_needs_several_processes(monkeypatch):
    for key in ("WORLD_SIZE", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(DraftsmithError, match="deepspeed=auto is plain torch in one process"):
        compose("train", ["data=/x", "precision=fp16"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert compose("train", ["data=/x", "precision=fp16"]).precision == "fp16"


def test_train_resolves_every_auto_into_a_new_config_and_a_record(monkeypatch):
    from draftsmith.train.run import resolve_auto

    on_cpu(monkeypatch, AVX2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    requested = compose("train", ["data=/x", "target=tiny"])
    cfg, resolved = resolve_auto(requested)
    assert (cfg.target.dtype, cfg.precision, cfg.deepspeed.config) == ("float32", "fp32", "none")
    assert (requested.target.dtype, requested.precision, requested.deepspeed.config) == ("auto", "auto", "auto")
    assert resolved["deepspeed"] == {"requested": "auto", "value": "none", "why": "one process: plain torch, no DeepSpeed"}
    assert resolved["precision"]["why"] == resolved["target.dtype"]["why"] == \
        "this CPU (AMD EPYC 7B13 64-Core Processor, AVX2) has no native bf16 matmul"


@pytest.mark.slow  # a training in a fresh process
def test_single_process_default_training_never_imports_deepspeed(tmp_path):
    """deepspeed=auto in one process is plain torch: DeepSpeed is not even imported (its CPU ops JIT-build with g++)."""
    from draftsmith.data_gen.target import TargetConfig, load_target
    from helpers import make_tiny_data

    data = make_tiny_data(tmp_path / "d", load_target(TargetConfig(name="tiny", dtype="float32")), n=4)
    out = tmp_path / "out"
    code = textwrap.dedent(f"""
        import sys
        from draftsmith.cli import main
        main(["train", "method=eagle3", "target=tiny", "wandb.mode=disabled", "progress=false",
              "method.draft_vocab_size=128", "method.ttt_steps=2", "micro_batch_size=2", "max_steps=1",
              "data={data}", "out={out}"])
        print("deepspeed imported:", "deepspeed" in sys.modules)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SLURM_STEP_ID")}
    result = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONWARNINGS": "ignore"},
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "deepspeed imported: False" in result.stdout
    assert result.stdout.count("dtype auto -> ") == 1 and "deepspeed auto -> none: one process" in result.stdout
    saved = (out / "config.yaml").read_text()
    assert "config: none" in saved and "precision: auto" not in saved and "dtype: auto" not in saved


def test_the_cli_flushes_subnormals_to_zero():
    """After the CLI's process setup a subnormal fp32 input computes as zero (FTZ / DAZ), in a fresh process."""
    code = ("import sys, torch\n"
            "from draftsmith import cli\n"
            "before = (torch.tensor([1e-39]) * 1.0).item()\n"
            "sys.argv = ['draftsmith', 'export', '--cfg', 'job', 'head=h']\n"
            "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
            "after = (torch.tensor([1e-39]) * 1.0).item()\n"
            "print(before, after)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    before, after = map(float, out.stdout.split()[-2:])
    assert before != 0.0 and after == 0.0, out.stdout + out.stderr
