"""llama.cpp beside draftsmith: the engine CPU users serve GGUF models in.

`bash scripts/setup.sh --engine` builds llama-server from the tree vendored in the PyPI sdist llama-cpp-python
(scripts/build_llamacpp.sh, cached by version in $DRAFTSMITH_CACHE/llamacpp). The converter
(`convert_hf_to_gguf.py`) and its `gguf-py` come from the same tree: PyPI gguf has no EAGLE-3 writer.

    llamacpp_home()     the cached build's folder (src/, build/bin/llama-server)
    llamacpp_missing()  None when llama-server and the converter are there, else the sentence that says why not
    convert(...)        an HF folder -> one GGUF file, with the vendored converter (written to a temporary name)
    OUTTYPES, OUTTYPE   the drafter GGUF's weight types draftsmith writes (`gguf_outtype`; eval measures each of its
                        `gguf_outtypes`) and their default
    Server              one llama-server on a free loopback port: started, checked, always stopped (its command
                        line from server_command; the speculative flags are eval/cost.py `llamacpp_settings`')

A request's speculative figures come from llama-server's Prometheus counters (`--metrics`), read before and
after it: with one slot (`-np 1`) and one request at a time the difference is that request's. They count as
vLLM's do (tools/server/server-context.cpp): a verification that had a draft is one `num_drafts`, each accepted
draft position adds to its `num_accepted_tokens_per_pos`, τ = 1 + accepted / drafts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

from . import DraftsmithError

VERSION = "0.3.36"  # PyPI llama-cpp-python, whose sdist vendors the llama.cpp tree built here
COMMIT = "0c1e570"  # the vendored llama.cpp commit (the sdist's submodule)
BUILD = "bash scripts/setup.sh --engine"
HOME_ENV = "DRAFTSMITH_LLAMACPP"  # a llama.cpp folder of the same layout (src/, build/bin/) instead of the cache
LOG_TAIL = 3000  # characters of llama-server's log quoted in an error
STARTUP_S = 300


def llamacpp_home() -> Path:
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV])
    cache = Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))
    return cache / "llamacpp" / f"{VERSION}-{COMMIT}"


def server_binary() -> Path:
    return llamacpp_home() / "build" / "bin" / "llama-server"


def converter() -> Path:
    return llamacpp_home() / "src" / "convert_hf_to_gguf.py"


def llamacpp_missing() -> Optional[str]:
    """None when llama-server and the converter are there; else one sentence and the command that builds them."""
    if not server_binary().is_file():
        return f"llama.cpp not built: {server_binary()} does not exist ({BUILD})"
    if not converter().is_file():
        return f"llama.cpp's converter is missing: {converter()} does not exist ({BUILD})"
    return None


def _require() -> None:
    missing = llamacpp_missing()
    if missing:
        raise DraftsmithError(f"{missing}.")


# --------------------------------------------------------------------------- GGUF conversion

# A drafter's GGUF weight type (the converter's --outtype): export's and publish's `gguf_outtype`; eval measures
# every type of its `gguf_outtypes` side by side, [OUTTYPE] by default
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# q8_0: the fastest or tied-fastest type on both CPU kinds measured, never slower than f32, at the same tau within
# 0.015 (docs/llamacpp.md "gguf_outtype"): a drafter's cost in llama.cpp is not its weight bytes here (the target's
# verification of the drafted rows is), but every type's run was at or below q8_0's
OUTTYPE = "q8_0"


def convert(hf_folder: Path, out_file: Path, outtype: str = OUTTYPE, target_dir: Optional[Path] = None,
            timeout_s: float = 1800) -> Path:
    """Write `hf_folder` as the GGUF `out_file` with llama.cpp's own converter (its in-tree gguf-py).

    `target_dir`: the target's HF folder (config.json + tokenizer), which the converter reads for an EAGLE-3
    head (`--target-model-dir`). Written to a temporary name beside `out_file`, renamed when complete."""
    _require()
    out_file = Path(out_file)
    tmp = out_file.with_name(f".{out_file.name}.tmp")
    command = [sys.executable, str(converter()), str(hf_folder), "--outfile", str(tmp), "--outtype", outtype]
    if target_dir is not None:
        command += ["--target-model-dir", str(target_dir)]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the tree's gguf-py, not PyPI's
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        tmp.unlink(missing_ok=True)
        raise DraftsmithError(f"llama.cpp's converter ran past {timeout_s:.0f} s on {hf_folder}.") from None
    if done.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = (done.stderr or done.stdout).strip()[-LOG_TAIL:]
        raise DraftsmithError(f"llama.cpp's converter could not convert {hf_folder} (exit {done.returncode}): {tail}")
    os.replace(tmp, out_file)
    return out_file


# --------------------------------------------------------------------------- the server

def server_command(model: str, draft: Optional[str], flags: Sequence[str], port: int | str = 8080,
                   threads: Optional[int] = None, ctx: int = 4096) -> list[str]:
    """llama-server's arguments: the target `model`, the drafter `draft` (-md), the speculative `flags`
    (eval/cost.py `llamacpp_settings`: --spec-type, K as --spec-draft-n-max), one slot on loopback."""
    command = [str(server_binary()), "-m", str(model)] + (["-md", str(draft)] if draft else []) + list(flags)
    command += ["--parallel", "1", "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port)]
    if threads:
        command += ["-t", str(threads), "-tb", str(threads)]
    return command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COUNTER = re.compile(r'^llamacpp:(spec_decode_\w+?)_total(?:\{position="(\d+)"\})?\s+(\S+)$')


def parse_metrics(text: str) -> dict:
    """llama-server's /metrics text -> vLLM-named counters (num_drafts, num_draft_tokens, num_accepted_tokens,
    num_accepted_tokens_per_pos)."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}
    per_pos: dict[int, int] = {}
    for line in text.splitlines():
        m = COUNTER.match(line.strip())
        if not m:
            continue
        name, pos, value = m.group(1).removeprefix("spec_decode_"), m.group(2), int(float(m.group(3)))
        if pos is not None:
            per_pos[int(pos)] = value
        elif name in out:
            out[name] = value
    out["num_accepted_tokens_per_pos"] = [per_pos.get(i, 0) for i in range(max(per_pos) + 1)] if per_pos else []
    return out


def counter_delta(before: dict, after: dict) -> dict:
    n = max(len(before["num_accepted_tokens_per_pos"]), len(after["num_accepted_tokens_per_pos"]))
    pad = lambda xs: list(xs) + [0] * (n - len(xs))  # noqa: E731
    return {key: after[key] - before[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")} | {
        "num_accepted_tokens_per_pos": [a - b for a, b in zip(pad(after["num_accepted_tokens_per_pos"]),
                                                              pad(before["num_accepted_tokens_per_pos"]))]}


class Server:
    """One llama-server for `model` (and the drafter `draft` with the speculative `flags`), on a free loopback port.

        with Server(target_gguf, head_gguf, ["--spec-type", "draft-eagle3", "--spec-draft-n-max", "3"]) as server:
            result = server.complete(prompt_ids, n_predict=64)

    Stopped on leaving the block, on an error and on Ctrl-C (its own process group). A server that exits or
    is not healthy within STARTUP_S raises one sentence with its log's tail; so does a drafter llama.cpp
    loaded without speculating (it logs the failure and serves on: /slots says so)."""

    def __init__(self, model: str, draft: Optional[str] = None, flags: Sequence[str] = (),
                 threads: Optional[int] = None, ctx: int = 4096, what: str = "llama.cpp"):
        _require()
        self.port = _free_port()
        self.command = server_command(model, draft, flags, self.port, threads, ctx) + ["--metrics"]
        self.speculative = bool(flags)
        self.what = what
        self.proc: Optional[subprocess.Popen] = None
        self._log = tempfile.NamedTemporaryFile(prefix="draftsmith-llama-server-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_healthy()
            slots = self._get("/slots")
            if self.speculative and not all(slot.get("speculative") for slot in slots):
                raise DraftsmithError(f"{self.what}: llama-server loaded the drafter but cannot speculate with it; "
                                      f"its log ends: {self.log_tail()}")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        assert self.proc is not None  # started by __enter__
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DraftsmithError(f"{self.what}: llama-server exited with status {self.proc.returncode} at "
                                      f"start; its log ends: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise DraftsmithError(f"{self.what}: llama-server was not ready after {STARTUP_S} s; its log ends: "
                              f"{self.log_tail()}")

    def _get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            body = r.read().decode()
        return body if path == "/metrics" else json.loads(body)

    def counters(self) -> dict:
        return parse_metrics(self._get("/metrics"))

    def complete(self, prompt_ids: list[int], n_predict: int, timeout_s: float = 1800) -> dict:
        """Greedy decode of the token ids `prompt_ids` (no BOS added, no prompt cache): the generated ids, the
        wall seconds, llama.cpp's timings and this request's speculative counters."""
        before = self.counters() if self.speculative else None
        body = json.dumps({"prompt": list(map(int, prompt_ids)), "n_predict": int(n_predict), "temperature": 0.0,
                           "top_k": 1, "seed": 0, "cache_prompt": False, "return_tokens": True}).encode()
        request = urllib.request.Request(self.url + "/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as r:
                result = json.loads(r.read().decode())
        except urllib.error.HTTPError as e:
            raise DraftsmithError(f"{self.what}: llama-server refused a request ({e.code}: "
                                  f"{e.read().decode(errors='replace')[:500]})") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise DraftsmithError(f"{self.what}: llama-server stopped answering ({e}); its log ends: "
                                  f"{self.log_tail()}") from None
        seconds = time.perf_counter() - start
        out = {"tokens": [int(t) for t in result.get("tokens") or []], "seconds": seconds,
               "timings": result.get("timings") or {}, "stop_type": result.get("stop_type")}
        if before is not None:  # a speculative server
            out["counters"] = counter_delta(before, self.counters())
        return out

    def log_tail(self) -> str:
        try:
            return Path(self._log.name).read_text(errors="replace")[-LOG_TAIL:].strip()
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)
