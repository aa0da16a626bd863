"""Shared fixtures: targets (tiny for unit tests, SmolLM2 for the few slow ones), config composition, tiny data and
questions, the engines and what their modules share. pytest finds them here: no test module imports conftest (the
plain functions and constants the tests share are in helpers.py)."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import MADE_ONCE_LOG, REQUIRE_ENV, builtin_decode, engine_required, made_once, make_tiny_data, shared_path

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
    # vLLM for CPU pins its OpenMP threads itself ("auto" may pick the same core in every worker): each worker's
    # engine gets the worker's own cores
    _first = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")) * _threads % (os.cpu_count() or 1)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{_first}-{_first + _threads - 1}")


@pytest.fixture(scope="session")
def tiny_target():
    from draftsmith.data_gen.target import TargetConfig, load_target

    return load_target(TargetConfig(name="tiny", dtype="float32"))


@pytest.fixture(scope="session")
def smollm2_target():
    from draftsmith.data_gen.target import TargetConfig, load_target

    return load_target(TargetConfig(name="smollm2", dtype="float32"))


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


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    """Four questions in two categories (writing, math), the first of two turns: question.jsonl's path."""
    path = tmp_path_factory.mktemp("prompts") / "question.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 2, "category": "math", "turns": ["What is 2+2?"]},
        {"question_id": 3, "category": "math", "turns": ["What is 3*3?"]},
        {"question_id": 4, "category": "writing", "turns": ["Say hi."]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """12 rows of offline data (hidden states included) from the tiny target."""
    from draftsmith.data_gen.target import TargetConfig, load_target

    return make_tiny_data(tmp_path_factory.mktemp("data"), load_target(TargetConfig(name="tiny", dtype="float32")),
                          n=12, hidden_states=True)


@pytest.fixture
def verifier_folder(tiny_target, tmp_path, monkeypatch):
    """The tiny target as an HF folder: speculators reads the verifier's config and norm from it (offline)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "verifier"
    tiny_target.model.save_pretrained(folder)
    return folder


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(items):
    """Every test that needs an engine (the engine_ready or llamacpp_ready fixture, directly or through another
    fixture) is marked `engine`: `pytest -m "not slow and not engine"` is the fast tier, whatever a module
    remembered to mark.

    Under `--dist loadgroup` a module's tests stay on one worker (its module-scoped setup, a training say, runs
    once). The engine modules share the test run's data-gen, heads and built-in readings through an on-disk cache
    (`made_once`), so they run on every worker side by side. Modules go out longest first (the engine ones, then the
    slow ones, then the rest; pyproject's addopts turn off xdist's own reordering by test count), and the short
    ones fill in at the end."""
    for item in items:
        if {"engine_ready", "llamacpp_ready"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)
        item.add_marker(pytest.mark.xdist_group(item.path.stem))  # test ids end in @<group>
    engine_modules = {item.path for item in items if item.get_closest_marker("engine")}
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (FIRST.index(item.path.stem) if item.path.stem in FIRST else len(FIRST),
                                 item.path not in engine_modules, item.path not in slow_modules))  # stable


# The first modules out, one to each worker: test_engine_vllm makes the shared data-gen and heads (made_once), and the
# other worker starts on a long module that needs none of them, where it would otherwise sit on their locks for the
# first ~90 s (data-gen, then the EAGLE-3 head). Its next module (an engine one) finds them made.
FIRST = ("test_engine_vllm", "test_decoder_sampling")


@pytest.fixture(scope="session")
def engine_ready():
    """The engine's python (vLLM for CPU in .venv-vllm), or a skip that says how to install it; where
    DRAFTSMITH_REQUIRE_ENGINE=1 (CI) a missing engine fails instead, so the engine tests are never silently green."""
    from draftsmith.core import engine

    require(engine.engine_missing(), "engine")
    return engine.engine_python()


@pytest.fixture(scope="session")
def llamacpp_ready():
    """llama.cpp's cached build (llama-server and the converter: bash scripts/setup.sh --engine) -> its folder, or a
    skip with the sentence that says how to build it; where DRAFTSMITH_REQUIRE_ENGINE=1 a missing build fails."""
    from draftsmith.core import llamacpp

    require(llamacpp.llamacpp_missing(), "llama.cpp")
    return llamacpp.llamacpp_home()


@pytest.fixture
def llamacpp_gguf(llamacpp_ready):
    """llama.cpp's own gguf-py (PyPI gguf has no EAGLE-3 keys, and draftsmith's target loader imports PyPI's): the
    in-tree package imported in place of any gguf already loaded, which comes back afterwards."""
    path = str(llamacpp_ready / "src" / "gguf-py")
    ours = lambda name: name == "gguf" or name.startswith("gguf.")  # noqa: E731
    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, path)
    try:
        import gguf

        assert Path(gguf.__file__).resolve().is_relative_to(Path(path).resolve()), gguf.__file__
        yield gguf
    finally:
        sys.path.remove(path)
        for name in [n for n in sys.modules if ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)


def require(missing, what: str) -> None:
    """A missing engine (`missing`: the sentence that says why, or None): a skip, or a failure where
    DRAFTSMITH_REQUIRE_ENGINE=1 (CI), so the engine tests are never silently green."""
    if missing:
        if engine_required():
            pytest.fail(f"{missing}; the {what} tests must run here ({REQUIRE_ENV}=1)")
        pytest.skip(missing)


@pytest.fixture(scope="session")
def smollm2_data(tmp_path_factory):
    """The test run's one data-gen output on the embedded SmolLM2 (16 self-written prompts, fp32, 64 tokens) with the
    target's hidden states (EAGLE-3, P-EAGLE and DFlash train offline from them) and its top-k log-probs (the draft
    model's offline signal): made once per test run, by whichever worker asks first. Read only."""
    from draftsmith.configs import compose
    from draftsmith.data_gen.run import run as data_gen

    def make(data: Path) -> None:
        data_gen(compose("data_gen", ["target=smollm2", "target.dtype=float32", "prompts=self", "prompts.n=16",
                                      "max_new_tokens=64", "hidden_states=true", "topk_logits=true", f"out={data}"]))

    return made_once(shared_path(tmp_path_factory, "engine-data") / "data", make)


@pytest.fixture(scope="session")
def engine_data(engine_ready, smollm2_data):
    """smollm2_data, for the engine modules (every one trains its heads on it and decodes its prompts): asks for the
    engine first, so a machine without it skips (or, in CI, fails) before any data-gen."""
    return smollm2_data


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
    # DFlash's shape plus the Markov and confidence heads (test_engine_llamacpp_block.py: its Markov control needs a
    # Markov head that changes drafts; with rank 64 it moved one acceptance in 128 drafts, 2026-12-06)
    "dspark": ["method=dspark", "epochs=16", "method.num_layers=2", "method.block_size=4",
               "method.draft_vocab_size=8192"],
    # EAGLE-3.1: all three norms on (test_engine_vllm_eagle31.py)
    "eagle3_31": ["method=eagle3", "epochs=8", "method.ttt_steps=3", "method.draft_vocab_size=8192",
                  "method.norm_before_fc=true", "method.fc_norm=true", "method.norm_output=true"],
}


@pytest.fixture(scope="session")
def engine_head(engine_data, tmp_path_factory):
    """engine_head(name) -> the `final/` folder of ENGINE_HEADS[name] trained on engine_data: trained on first use,
    by whichever worker asks first, then shared by every engine module of the test run. Read only."""
    from draftsmith.configs import compose
    from draftsmith.train.run import run as train

    def head(name: str) -> Path:
        def make(out: Path) -> None:
            train(compose("train", ENGINE_TRAIN + ENGINE_HEADS[name] + [f"data={engine_data}", f"out={out}"]))

        return made_once(shared_path(tmp_path_factory, "engine-heads") / name, make) / "final"

    return head


@pytest.fixture(scope="session")
def builtin_samples(engine_data, engine_head, tmp_path_factory):
    """builtin_samples(method, max_tokens) -> builtin_decode of the head ENGINE_HEADS[method] (or target_only, or
    ngram): decoded once per test run, by whichever worker asks first, and read back (JSON) by the rest. The
    engines' runs of each export are compared with these: the trained head's own reading, before any export."""
    from draftsmith.eval import run as ev
    from draftsmith.eval.metrics import Sample

    def samples(method: str, max_tokens: int) -> list[Sample]:
        def make(path: Path) -> None:
            head = None if method in (ev.TARGET_ONLY, "ngram") else engine_head(method)
            decoded = builtin_decode(engine_data, method, head, max_tokens, path.with_suffix(".eval"))
            path.write_text(json.dumps([dataclasses.asdict(s) for s in decoded]))

        path = made_once(shared_path(tmp_path_factory, "engine-builtin") / f"{method}-{max_tokens}.json", make)
        return [Sample(**fields) for fields in json.loads(path.read_text())]

    return samples


# --------------------------------------------------------------------------- where the suite's minutes go

_module_seconds: dict[str, float] = collections.defaultdict(float)
_module_spans: dict[str, list] = {}  # module -> [first start, last stop (epoch s), worker]: what ran beside what
_session_start = time.perf_counter()


def pytest_runtest_logreport(report):
    """Wall time per test module, fixtures' setup and teardown included (a module-scoped setup that trains heads
    counts toward its module's first test). Reports reach the controlling process under pytest-xdist too."""
    module = report.nodeid.split("::")[0]
    _module_seconds[module] += report.duration
    node = getattr(report, "node", None)  # pytest-xdist's worker, in the controlling process
    worker = node.gateway.id if node is not None else "-"
    span = _module_spans.setdefault(module, [report.start, report.stop, worker])
    span[0], span[1] = min(span[0], report.start), max(span[1], report.stop)


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
    # Two workers share 2 cores: a module beside a heavy one runs up to 1.6x slower (the vLLM job alone 160 s,
    # beside test_engine_llamacpp 237 s, beside the torchrun modules 255 s; docs/benchmarks.md), so say what overlapped
    tr.section("timeline: each module's first start and last stop, seconds since the first test began")
    t0 = min(span[0] for span in _module_spans.values())
    for name, (start, stop, worker) in sorted(_module_spans.items(), key=lambda kv: kv[1][0]):
        tr.write_line(f"{start - t0:7.0f} {stop - t0:7.0f}  {worker:>4}  {name}")
    log = terminalreporter.config._tmp_path_factory.getbasetemp() / MADE_ONCE_LOG
    if log.is_file():  # what the engine modules share, counted in the module that asked first
        tr.section("made once per run and shared (data-gen, heads, built-in readings), and the waits for them")
        for line in log.read_text().splitlines():
            m = json.loads(line)
            tr.write_line(f"{m['seconds']:8.1f} s  {m['worker']} {m['what']} {m['name']}")
