"""Regeneration: every assistant turn is rewritten by the target, conditioned on its own history.

Multi-turn conversations are regenerated round by round: round r prompts every conversation
with the target's own answers to rounds < r plus the r-th user segment, so turn 2's prompt
holds the target's answer to turn 1.

Backends (looked up in BACKENDS):
  hf      built in: draftsmith.data_gen.batching's continuous batching (a static KV cache whose
          rows, as their answers end, are refilled with waiting prompts).
  openai  any OpenAI-compatible server (`vllm serve`, SGLang): POST /v1/chat/completions with
          backend.concurrency requests in flight (default 256), kept in flight across chunk boundaries
          (`regenerate_in_order`); 429 / 408 / 5xx / dropped connections / timeouts are retried with
          backoff (backend.retries, backend.backoff_s, backend.backoff_max_s; draftsmith.core.retry).
  vllm    vLLM in-process in its own venv (draftsmith.core.engine runs core/vllm_generate.py there): one `LLM`
          on the target's HF folder per call, every conversation submitted at once (continuous batching).
A backend is built as `Backend(target, cfg, params, dtype)` (dtype: the name of the target's dtype, for a
backend that loads the target itself). Its `chat(conversations, seeds, done=None)` returns one answer per
conversation (a `Failed`, or None, when it gave up: not text) and calls `done(j)` as answer j is ready, for
progress. The hf and vllm backends render the chat template here (`prompt_ids`) and decode the answer tokens
here, so both see the same prompt tokens.

Sampling (draftsmith.core.sampling: the rule eval's decoder uses too) is reproducible per sample: each
conversation turn draws from its own generator, seeded from (seed, sample id, turn), so the same
sample gets the same answer whatever batch or rank it lands in.
"""

from __future__ import annotations

import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

from ..core import DraftsmithError, engine
from .batching import generate_tokens
from .config import BackendConfig
from .tokenize import apply_chat_template
from ..core.machine import dtype_name
from ..core.retry import Backoff, Transient, call, retry_after_s, retryable_status
from ..core.sampling import SamplingConfig, hash_seed


@dataclass
class SamplingParams(SamplingConfig):
    """What a backend generates with: the sampling rule and the answer length."""

    max_new_tokens: int = 256


# --- backends: conversations in, assistant texts out ------------------------------------------

def prompt_ids(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    """Each conversation rendered up to the assistant's header (the chat template) and tokenized."""
    texts = [apply_chat_template(tokenizer, c, tokenize=False, add_generation_prompt=True) for c in conversations]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


class HFBackend:
    """The built-in batched backend on the loaded target."""

    def __init__(self, target, cfg: BackendConfig, params: SamplingParams, dtype: Optional[str] = None):
        self.target, self.cfg, self.params = target, cfg, params  # (dtype: the loaded target's already)

    def chat(self, conversations: list[list[dict]], seeds: list[int], done=None) -> list[str | None]:
        """The answer to each conversation (None: failed); `done(j)` is called as answer j is ready."""
        tok = self.target.tokenizer
        outs = generate_tokens(self.target, prompt_ids(tok, conversations), self.params, seeds, self.cfg.batch_size,
                               self.cfg.prune_finished, desc="regenerate", done=done)
        return [tok.decode(o, skip_special_tokens=True) for o, _ in outs]


GENERATE_WORKER = Path(engine.__file__).with_name("vllm_generate.py")  # run by the engine's python, never imported
ENGINE_RUN = "generate"  # vllm_generate.py's one run in its result


class VLLMBackend:
    """vLLM in its own venv: one engine job per call, every conversation in it at once, `batch_size` decoded together.

    The prompts are rendered and tokenized here (`prompt_ids`, as the HF backend does) and sent as token ids; the
    answers come back as token ids and are decoded here. vLLM loads the target's HF folder (`engine.served_folder`) in the
    target's dtype, with `max_num_seqs = backend.batch_size`, and batches continuously; each call starts the engine
    once (tens of seconds on a CPU), so keep `regenerate_chunk` large. At temperature 0 it decodes greedily: the
    HF backend's answers up to near-ties (fp32). Above it each request samples from vLLM's sampler with its own
    seed (the seeds draftsmith passes): reproducible per sample, but not the HF backend's draws. Answers stop at
    the target's EOS ids or max_new_tokens. `done(j)` is called as the engine reports answer j finished (the
    worker appends each finished index to a file that a thread here follows).
    """

    def __init__(self, target, cfg: BackendConfig, params: SamplingParams, dtype: Optional[str] = None):
        missing = engine.engine_missing()
        if missing:
            raise DraftsmithError(f"backend=vllm: {missing}.")
        self.target, self.cfg, self.params = target, cfg, params
        self.folder = engine.served_folder(target, "backend=vllm")
        self.dtype = dtype or dtype_name(target.dtype)  # (without one: the loaded model's; loads it)
        self.last_run: Optional[dict] = None  # the last job's vllm_version, seconds, load_s, warnings (benchmarks)

    def chat(self, conversations: list[list[dict]], seeds: list[int], done=None) -> list[str]:
        """The answer to each conversation; `done(j)` is called as answer j is ready."""
        tok = self.target.tokenizer
        outs = self.generate(prompt_ids(tok, conversations), seeds, done=done)
        return [tok.decode(o, skip_special_tokens=True) for o in outs]

    def generate(self, prompts: list[list[int]], seeds: list[int], done=None) -> list[list[int]]:
        """Each prompt's answer tokens (its stop token included), from one engine job."""
        if not prompts:
            return []
        p = self.params
        with tempfile.TemporaryDirectory(prefix="draftsmith-vllm-") as tmp:
            progress = Path(tmp) / "progress"
            job = {"target": self.folder, "dtype": self.dtype, "max_num_seqs": self.cfg.batch_size,
                   "max_model_len": max(map(len, prompts)) + p.max_new_tokens, "prompts": prompts,
                   "seeds": list(seeds), "greedy": p.greedy, "temperature": p.temperature, "top_p": p.top_p,
                   "top_k": p.top_k, "max_tokens": p.max_new_tokens, "stop_token_ids": self.target.eos_token_ids,
                   "progress": str(progress)}
            with _following(progress, len(prompts), done):
                # no time bound, as the hf backend has none: the engine's startup and the decoding of a whole
                # chunk on a CPU take what they take
                result = engine.run_job(job, timeout_s=None, worker=GENERATE_WORKER)
                run = result["runs"].get(ENGINE_RUN) or {}
                if not run.get("ok"):
                    raise DraftsmithError(f"backend=vllm: vLLM could not generate with {self.folder} "
                                          f"({run.get('error', 'no result')}).")
        self.last_run = {"vllm_version": result["vllm_version"], **{k: v for k, v in run.items() if k != "tokens"}}
        return run["tokens"]


@contextmanager
def _following(path: Path, n: int, done):
    """Call done(j) for each index the engine appends to `path` (one a line) while the block runs, from a
    thread here; then for those it never reported, once the block finished without an error."""
    if done is None:
        yield
        return
    seen: set[int] = set()
    stop = threading.Event()

    def report() -> None:
        try:
            lines = path.read_text().splitlines(keepends=True)
        except OSError:
            return
        for line in lines:
            if line.endswith("\n") and line.strip().isdigit() and int(line) not in seen and int(line) < n:
                seen.add(int(line))
                done(int(line))

    def follow() -> None:
        while not stop.wait(0.5):
            report()

    thread = threading.Thread(target=follow, name="vllm-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    report()
    for j in range(n):
        if j not in seen:
            done(j)


@dataclass(frozen=True)
class Failed:
    """What a backend returns in place of an answer it gave up on: the last error ("HTTP 503: overloaded",
    "timed out after 30 s", ...) and how many tries it made. Falsy, like the None it replaces."""

    reason: str
    tries: int = 1

    @property
    def kind(self) -> str:
        """The reason without its detail ("HTTP 503"): what failures are grouped by."""
        return self.reason.split(": ", 1)[0]

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return self.reason + (f" (after {self.tries} tries)" if self.tries > 1 else "")


class _Refused(Exception):
    """A request that will not get better by asking again (4xx other than 408 / 429, a bad URL)."""


class _CannotConnect(Exception):
    """Nothing listens at the URL (connection refused, unknown host)."""


_DEADLINE = threading.local()  # .at: time.monotonic() by which this thread's request must be finished


def _bounded(timeout, error):
    """A socket operation's timeout, shortened to what is left of this thread's deadline (error once it passed)."""
    at = getattr(_DEADLINE, "at", None)
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        import httpcore

        raise getattr(httpcore, error)("the request's deadline passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream:
    """httpcore network stream whose every read / write waits no longer than the request's deadline, so
    timeout_s bounds a whole request even against a server that trickles one byte at a time."""

    def __init__(self, stream):
        self._stream = stream

    def read(self, max_bytes: int, timeout=None) -> bytes:
        return self._stream.read(max_bytes, _bounded(timeout, "ReadTimeout"))

    def write(self, buffer: bytes, timeout=None) -> None:
        self._stream.write(buffer, _bounded(timeout, "WriteTimeout"))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, _bounded(timeout, "ConnectTimeout")))

    def get_extra_info(self, info: str):
        return self._stream.get_extra_info(info)


class _DeadlineBackend:
    """httpcore network backend handing out _DeadlineStreams (connection pooling is kept)."""

    def __init__(self, backend):
        self._backend = backend

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        return _DeadlineStream(self._backend.connect_tcp(host, port, _bounded(timeout, "ConnectTimeout"),
                                                         local_address, socket_options))

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        return _DeadlineStream(self._backend.connect_unix_socket(path, _bounded(timeout, "ConnectTimeout"),
                                                                 socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


def _bound_by_deadline(client) -> bool:
    """Route the client's connections (its own transport and any proxy mounts) through _DeadlineBackend;
    False when this httpx / httpcore keeps its pools elsewhere (timeout_s then bounds each read only)."""
    done = False
    for transport in [client._transport, *getattr(client, "_mounts", {}).values()]:
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if pool is not None and backend is not None:  # (a backend comes from a pool)
            if not isinstance(backend, _DeadlineBackend):
                pool._network_backend = _DeadlineBackend(backend)
            done = done or transport is client._transport
    return done


def _snippet(text: str, n: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n] + "..."


def _server_message(r) -> str:
    """What the server said about an error: OpenAI's error.message, vLLM's message, FastAPI's detail, or its text."""
    try:
        obj = r.json()
    except ValueError:
        obj = None
    msg = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict):
            msg = err.get("message")
        elif isinstance(err, str):
            msg = err
        if msg is None:
            msg = obj.get("message", obj.get("detail"))
    return _snippet(r.text if msg is None else msg)


class OpenAIBackend:
    """Any OpenAI-compatible server: one /chat/completions request per turn, `concurrency` in flight.

    `chat` may be called from several threads at once (`regenerate_in_order` does, one chunk each): their
    requests share the same `concurrency` slots, so the server sees that many in flight across the calls.

    Each try of a request must finish within `timeout_s` (connect to last byte). 429, 408, 5xx, a
    dropped or reset connection and a timeout are tried again, up to `retries` times, after a jittered
    exponential backoff (draftsmith.core.retry; a Retry-After is honoured up to `backoff_max_s`); a retry
    waits in its worker, so no more than `concurrency` requests are ever in flight. Other 4xx are not
    retried. A conversation that still fails comes back as a `Failed` (its last error), not an answer.
    """

    def __init__(self, target, cfg: BackendConfig, params: SamplingParams, dtype: Optional[str] = None):
        import httpx

        self.cfg, self.params = cfg, params
        self.url = cfg.url.rstrip("/")
        self.backoff = Backoff(retries=cfg.retries, base_s=cfg.backoff_s, max_s=cfg.backoff_max_s)
        n = max(1, cfg.concurrency)
        self.client = httpx.Client(timeout=cfg.timeout_s,
                                   limits=httpx.Limits(max_connections=max(100, n), max_keepalive_connections=max(20, n)))
        _bound_by_deadline(self.client)
        self._down: str | None = None  # set once a request ran out of tries on a server nobody answers at
        self.slots = n  # requests in flight at most, over every chat call running at once
        self._slots = threading.BoundedSemaphore(n)
        self.model = cfg.model or self._first_model()

    def _try(self, method: str, path: str, **kw):
        """One try: the response (status < 400); Transient for what may pass, _Refused for what will not."""
        import httpx

        _DEADLINE.at = time.monotonic() + self.cfg.timeout_s
        try:
            r = self.client.request(method, self.url + path, **kw)
        except httpx.TimeoutException:
            raise Transient(f"timed out after {self.cfg.timeout_s:g} s") from None
        except httpx.ConnectError as e:
            raise _CannotConnect(str(e) or type(e).__name__) from None
        except httpx.RemoteProtocolError as e:
            raise Transient(f"connection dropped: {str(e) or type(e).__name__}") from None
        except httpx.NetworkError as e:
            raise Transient(f"connection reset: {str(e) or type(e).__name__}") from None
        except httpx.TransportError as e:  # a URL httpx cannot use, a proxy error, ...
            raise _Refused(f"request failed: {str(e) or type(e).__name__}") from None
        finally:
            _DEADLINE.at = None
        if r.status_code >= 400:
            why = f"HTTP {r.status_code}: {_server_message(r)}"
            if retryable_status(r.status_code):
                raise Transient(why, retry_after=retry_after_s(r.headers.get("Retry-After")))
            raise _Refused(why)
        return r

    def _first_model(self) -> str:
        where = f"GET {self.url}/models"
        skip = "set backend.model=<served model name> to skip the lookup"

        def once():
            try:
                return self._try("GET", "/models")
            except _CannotConnect as e:
                raise DraftsmithError(f"cannot reach the OpenAI-compatible server at {self.url} ({e}); "
                                      f"start it or set backend.url.") from None

        try:
            r = call(once, self.backoff)
        except Transient as e:
            raise DraftsmithError(f"{where} failed after {e.attempts} tries ({e.reason}); check the server, "
                                  f"or {skip}.") from None
        except _Refused as e:
            raise DraftsmithError(f"{where} was refused ({e}); backend.url must be the server's OpenAI base URL "
                                  f"(usually ending in /v1), or {skip}.") from None
        try:
            obj = r.json()
        except ValueError:
            raise DraftsmithError(f"{where} answered text that is not JSON ({_snippet(r.text, 80)!r}); backend.url must be "
                                  f"the server's OpenAI base URL (usually ending in /v1), or {skip}.") from None
        listed = obj.get("data") if isinstance(obj, dict) else None
        ids = [m.get("id") for m in listed if isinstance(m, dict)] if isinstance(listed, list) else []
        names = [m for m in ids if isinstance(m, str) and m]
        if not names:
            raise DraftsmithError(f"the server at {self.url} lists no model ({where} answered "
                                  f"{_snippet(r.text, 80)!r}); {skip}.")
        return names[0]

    def _post(self, body: dict):
        try:
            return self._try("POST", "/chat/completions", json=body)
        except _CannotConnect as e:
            raise Transient(f"cannot connect: {e}") from None

    def stop(self, why: str) -> None:
        """Send no more requests (those in flight finish): every later one fails at once with `why`."""
        self._down = why

    def _one(self, messages: list[dict], seed: int) -> str | Failed:
        body = {"model": self.model, "messages": messages, "max_tokens": self.params.max_new_tokens,
                "temperature": self.params.temperature, "top_p": self.params.top_p, "seed": seed % (1 << 31)}
        with self._slots:  # (a retry's backoff keeps its slot: never more than `concurrency` in flight)
            if self._down is not None:  # the server is gone, or the run stopped: fail fast, a rerun asks again
                return Failed(self._down, 0)
            return self._answer(body)

    def _answer(self, body: dict) -> str | Failed:
        try:
            r = call(lambda: self._post(body), self.backoff)
        except Transient as e:
            if e.reason.startswith("cannot connect"):
                self._down = e.reason
            return Failed(e.reason, e.attempts)
        except _Refused as e:
            return Failed(str(e))
        try:
            content = r.json()["choices"][0]["message"]["content"]
        except ValueError:
            return Failed(f"reply is not JSON: {_snippet(r.text, 80)!r}")
        except (KeyError, IndexError, TypeError):
            return Failed(f"reply is not a chat completion: no choices[0].message.content in {_snippet(r.text, 80)!r}")
        if not isinstance(content, str):
            return Failed(f"reply is not text: message.content is {type(content).__name__} ({_snippet(repr(content), 40)})")
        return content

    def chat(self, conversations: list[list[dict]], seeds: list[int], done=None) -> list[str | Failed]:
        with ThreadPoolExecutor(max_workers=max(1, self.cfg.concurrency)) as pool:
            futures = {pool.submit(self._one, c, s): j for j, (c, s) in enumerate(zip(conversations, seeds))}
            for f in as_completed(futures):
                if done is not None:
                    done(futures[f])
            return [f.result() for f in futures]


BACKENDS = {"hf": HFBackend, "openai": OpenAIBackend, "vllm": VLLMBackend}


def make_backend(target, cfg: BackendConfig, params: SamplingParams, dtype: Optional[str] = None):
    """The backend of cfg.kind; `dtype` is the name of the target's dtype (vllm loads the target in it)."""
    if cfg.kind not in BACKENDS:
        raise DraftsmithError(f"backend.kind={cfg.kind!r} is not one of {', '.join(BACKENDS)}.")
    return BACKENDS[cfg.kind](target, cfg, params, dtype)


# --- conversations ------------------------------------------------------------------------------

def user_segments(messages: list[dict]) -> list[list[dict]]:
    """The messages each assistant turn answers, ending at a user turn: [sys,u1,a1,u2] -> [[sys,u1],[u2]].

    Source assistant turns are dropped (they are regenerated); consecutive user turns (MT-bench
    `turns`) each get their own answer.
    """
    segments, current = [], []
    for m in messages:
        if m["role"] == "assistant":
            continue
        current.append(m)
        if m["role"] == "user":
            segments.append(current)
            current = []
    return segments


def regenerate_all(samples: list[dict], backend, seed: int, bar=None, errors: dict | None = None
                   ) -> list[list[dict] | None]:
    """Every sample's regenerated messages, in order (None: a turn failed; []: no user turn, left out).

    `bar.update(1)` per finished sample, as answers come back; `errors`, when given, gets
    {sample index: Failed} for every failed sample (its last error).
    """
    segments = [user_segments(s["messages"]) for s in samples]
    history: list[list[dict] | None] = [[] for _ in samples]
    for turn in range(max((len(s) for s in segments), default=0)):
        live = [i for i, s in enumerate(segments) if turn < len(s) and history[i] is not None]
        convs = [h + segments[i][turn] for i in live if (h := history[i]) is not None]  # (every live one's is set)
        seeds = [hash_seed(seed, samples[i]["id"], turn) for i in live]
        last = [turn == len(segments[i]) - 1 for i in live]
        done = None if bar is None else (lambda j, last=last: bar.update(1) if last[j] else None)  # this turn's `last`
        answers = backend.chat(convs, seeds) if done is None else backend.chat(convs, seeds, done=done)
        for j, (i, conv, text) in enumerate(zip(live, convs, answers)):
            ok = isinstance(text, str)
            history[i] = conv + [{"role": "assistant", "content": text}] if ok else None
            if not ok and errors is not None:
                errors[i] = text if isinstance(text, Failed) else Failed("no answer")
            if not ok and bar is not None and not last[j]:
                bar.update(1)  # a failed sample is finished too
    if bar is not None and not all(segments):
        bar.update(sum(not s for s in segments))  # nothing to answer ([]: left out, not failed)
    return history


def jobs_at_once(backend, size: int) -> int:
    """How many chunks of `size` prompts are regenerated at once: for a server (a backend with `slots`), enough that
    while the oldest chunk waits for its last answers the others fill every slot; else one (a backend that decodes
    a batch itself, on the target here or in one engine job, runs one chunk at a time)."""
    slots = getattr(backend, "slots", 0)
    return 1 + -(-slots // max(1, size)) if slots else 1


def regenerate_in_order(jobs: list[list[dict]], backend, seed: int, finished: Callable, bar=None,
                        regenerate: Optional[Callable] = None) -> None:
    """`regenerate(samples, backend, seed, bar, errors)` (default `regenerate_all`) of each job (a chunk's samples);
    `finished(k, messages, errors)` is called in this thread, in job order, as soon as jobs 0..k are all done
    (errors: {sample index in the job: Failed}).

    A server's backend (`jobs_at_once` > 1) keeps its requests in flight across job boundaries: jobs k + 1 .. k + w - 1
    run, each on its own thread, while job k's last answers come back, and job k + w starts once job k is finished
    and handed over. So a kill loses at most the w jobs running and the one being handed over (a rerun regenerates
    them), and `finished` sees the same jobs in the same order as a sequential loop. An error (in `finished`, or a Ctrl-C)
    stops the backend's further requests and is raised here once the running jobs have returned.
    """
    lock = threading.Lock()

    def update(n: int = 1) -> None:  # the bar is shared by the jobs' threads
        with lock:
            bar.update(n)

    shared_bar = None if bar is None else SimpleNamespace(update=update)

    def one(samples: list[dict]) -> tuple[list, dict]:
        errors: dict = {}
        return (regenerate or regenerate_all)(samples, backend, seed, shared_bar, errors), errors

    width = jobs_at_once(backend, max(map(len, jobs), default=1))
    if width == 1:
        for k, samples in enumerate(jobs):
            finished(k, *one(samples))
        return
    pool = ThreadPoolExecutor(max_workers=width, thread_name_prefix="regenerate")
    running = {k: pool.submit(one, jobs[k]) for k in range(min(width, len(jobs)))}
    try:
        for k in range(len(jobs)):
            messages, errors = running.pop(k).result()
            if k + width < len(jobs):
                running[k + width] = pool.submit(one, jobs[k + width])
            finished(k, messages, errors)
    except BaseException:
        getattr(backend, "stop", lambda why: None)("stopped: the run ended early")
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def regenerate(samples: list[dict], backend, seed: int) -> tuple[list[dict], int]:
    """Replace every assistant turn with the target's own answer; returns (samples, failed count)."""
    history = regenerate_all(samples, backend, seed)
    out = [{**s, "messages": h} for s, h in zip(samples, history) if h]
    return out, sum(h is None for h in history)
