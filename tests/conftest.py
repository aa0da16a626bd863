"""Shared fixtures: targets (tiny for unit tests, SmolLM2 for the few slow ones) and config composition."""

from __future__ import annotations

import collections
import os
import time

import pytest
import torch

# The engine tests read vLLM's counters, never its speed: its engine core runs in the worker's own process instead of
# one spawned per LLM (~5 s a start instead of ~36 s on 2 cores). Measured equal, tokens, counters and per-request
# detail of all 13 runs of test_engine_vllm.py's job: docs/results/vllm-inprocess-vs-multiprocess-2026-12-03.txt.
# `draftsmith eval engine=vllm` keeps vLLM's default for users: its tokens/s are the serving figures.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# Under pytest-xdist (the README's `-n auto`) each worker gets its share of the cores and its children (torchrun
# ranks, the vLLM engine) inherit it: two workers each running 2 OpenMP threads on 2 cores spin against each other,
# and small-op decoding collapses 10-50x.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


@pytest.fixture(scope="session")
def tiny_target():
    from draftsmith.data_gen.target import TargetConfig, load_target

    return load_target(TargetConfig(name="tiny"))


@pytest.fixture(scope="session")
def smollm2_target():
    from draftsmith.data_gen.target import TargetConfig, load_target

    return load_target(TargetConfig(name="smollm2"))


@pytest.fixture
def compose_cfg():
    """compose_cfg(stage, *overrides): the stage's config as the CLI would build it."""
    from draftsmith.configs import compose

    return lambda stage, *overrides: compose(stage, list(overrides))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread: more threads only add contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(items):
    """Every test that needs the engine (the engine_ready fixture, directly or through another fixture) is marked
    `engine`: `pytest -m "not slow and not engine"` is the fast tier, whatever a module remembered to mark.

    Under `--dist loadgroup` a module's tests stay on one worker (its module-scoped setup, a training say, runs
    once), and every engine test goes to one worker: the session's engine data and heads are made once, and two
    vLLM engines never share the cores."""
    for item in items:
        if "engine_ready" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.engine)
            item.add_marker(pytest.mark.xdist_group("engine"))
        else:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))  # test ids end in @<group>


@pytest.fixture(scope="session")
def engine_ready():
    """The engine's python (vLLM for CPU in .venv-vllm), or a skip that says how to install it; where
    DRAFTSMITH_REQUIRE_ENGINE=1 (CI) a missing engine fails instead, so the engine tests are never silently green."""
    from draftsmith import engine

    require(engine.engine_missing(), "engine")
    return engine.engine_python()


@pytest.fixture(scope="session")
def llamacpp_ready():
    """llama.cpp's cached build (llama-server and the converter: bash scripts/setup.sh --engine) -> its folder, or a
    skip with the sentence that says how to build it; where DRAFTSMITH_REQUIRE_ENGINE=1 a missing build fails."""
    from draftsmith import llamacpp

    require(llamacpp.llamacpp_missing(), "llama.cpp")
    return llamacpp.llamacpp_home()


def require(missing, what: str) -> None:
    """A missing engine (`missing`: the sentence that says why, or None): a skip, or a failure where
    DRAFTSMITH_REQUIRE_ENGINE=1 (CI), so the engine tests are never silently green."""
    from draftsmith import engine

    if missing:
        if engine.engine_required():
            pytest.fail(f"{missing}; the {what} tests must run here ({engine.REQUIRE_ENV}=1)")
        pytest.skip(missing)


@pytest.fixture(scope="session")
def engine_data(engine_ready, tmp_path_factory):
    """The engine tests' one data-gen output (16 self-written prompts of the embedded SmolLM2, fp32, 64 tokens) with
    the target's hidden states (EAGLE-3, P-EAGLE and DFlash train offline from them) and its top-k log-probs (the
    draft model's offline signal): every engine module trains its heads on it and decodes its prompts, so it is
    made once per session. Read only."""
    from draftsmith.configs import compose
    from draftsmith.data_gen.run import run as data_gen

    data = tmp_path_factory.mktemp("engine-data") / "data"
    data_gen(compose("data_gen", ["target=smollm2", "target.dtype=float32", "prompts=self", "prompts.n=16",
                                  "max_new_tokens=64", "hidden_states=true", "topk_logits=true", f"out={data}"]))
    return data


# What the engine modules train on engine_data, by name: each head is trained once per session, offline (from the
# hidden-state shards or the top-k cache: the frozen target never runs in the training loop), at precision=auto
# (bf16 where this CPU has fast bf16 matmul, fp32 elsewhere: on an AVX2-only CPU bf16 autocast is ~90x slower).
ENGINE_TRAIN = ["target=smollm2", "target.dtype=float32", "mode=offline", "deepspeed=none", "precision=auto",
                "lr=1e-3", "wandb.mode=disabled", "progress=false", "save_every=100000"]
ENGINE_HEADS = {
    "eagle3": ["method=eagle3", "epochs=8", "method.ttt_steps=3", "method.draft_vocab_size=8192"],
    "peagle": ["method=peagle", "epochs=8", "method.num_layers=2", "method.depths=4", "method.draft_vocab_size=8192"],
    "draft": ["method=draft", "epochs=4", "lr=3e-4", "method.num_layers=4"],
    # block_size = K + 1 of test_engine_vllm_dflash.py
    "dflash": ["method=dflash", "epochs=16", "method.num_layers=2", "method.block_size=4",
               "method.draft_vocab_size=8192"],
    # EAGLE-3.1: all three norms on (test_engine_vllm_eagle31.py)
    "eagle3_31": ["method=eagle3", "epochs=8", "method.ttt_steps=3", "method.draft_vocab_size=8192",
                  "method.norm_before_fc=true", "method.fc_norm=true", "method.norm_output=true"],
}


@pytest.fixture(scope="session")
def engine_head(engine_data, tmp_path_factory):
    """engine_head(name) -> the `final/` folder of ENGINE_HEADS[name] trained on engine_data: trained on first use,
    then shared by every engine module of the session. Read only."""
    from draftsmith.configs import compose
    from draftsmith.train.run import run as train

    root = tmp_path_factory.mktemp("engine-heads")
    done: dict[str, object] = {}

    def head(name: str):
        if name not in done:
            train(compose("train", ENGINE_TRAIN + ENGINE_HEADS[name] + [f"data={engine_data}", f"out={root / name}"]))
            done[name] = root / name / "final"
        return done[name]

    return head


# --------------------------------------------------------------------------- where the suite's minutes go

_module_seconds: dict[str, float] = collections.defaultdict(float)
_session_start = time.perf_counter()


def pytest_runtest_logreport(report):
    """Wall time per test module, fixtures' setup and teardown included (a module-scoped setup that trains heads
    counts toward its module's first test). Reports reach the controlling process under pytest-xdist too."""
    _module_seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    """Per-module wall time, slowest first: CI's output says where the minutes go (beside --durations)."""
    if not _module_seconds:
        return
    total = time.perf_counter() - _session_start
    workers = getattr(terminalreporter.config.option, "numprocesses", None)  # pytest-xdist's -n, in this process
    tr = terminalreporter
    tr.section("wall time per test module (setup + call + teardown)")
    for name, seconds in sorted(_module_seconds.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"{seconds:8.1f} s  {name}")
    tr.write_line(f"{sum(_module_seconds.values()):8.1f} s  in tests (summed over {workers or 1} worker(s)), "
                  f"{total:.1f} s since the session started")
