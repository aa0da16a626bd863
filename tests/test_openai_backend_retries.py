"""backend=openai under a misbehaving server: 429 / 5xx / dropped connections / hangs / trickled bytes are
retried with a bounded backoff, what still fails is named per prompt and never recorded as done (a rerun
retries it), more failures than backend.max_failed_share end the run with one sentence (CLI exit 2), and
a broken /v1/models or a reply that is not text is one sentence, never a traceback.

Every test talks to a loopback ThreadingHTTPServer (127.0.0.1, port 0) that its fixture shuts down;
backoffs are a few milliseconds and timeouts under a second, so the file runs in seconds."""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from draftsmith.core import DraftsmithError
from draftsmith.data_gen.config import BackendConfig
from draftsmith.data_gen.regenerate import SamplingParams, make_backend

pytestmark = pytest.mark.timeout(60)

FAST = ("backend.backoff_s=0.001", "backend.backoff_max_s=0.01")


class Plan:
    """What the test server does: `rule(n, key, tries)` picks the action of POST number n (1-based) for
    the prompt `key` (its last message) on its `tries`-th request; `models` the answer to GET /models."""

    def __init__(self):
        self.lock = threading.Lock()
        self.posts: list[str] = []  # prompt keys, in the order received
        self.times: dict[str, list[float]] = {}
        self.models = "ok"  # ok | 500 | nonjson
        self.rule = lambda n, key, tries: "ok"
        self.hold_s = 0.0  # every answer waits this long (to see requests overlap)
        self.inflight = self.max_inflight = 0
        self.stop = threading.Event()
        self.url = ""

    def tries(self, key: str) -> int:
        return self.posts.count(key)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # a burst of retries must not overflow the listen backlog (a SYN retried after 1 s)

    def handle_error(self, request, client_address):
        pass  # (a reset connection's handler cannot finish its reply: expected)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # (headers and body are two writes: no 40 ms delayed-ACK stall per reply)

    def log_message(self, *args):
        pass

    @property
    def plan(self) -> Plan:
        return self.server.plan

    def _send(self, code: int, obj=None, raw: bytes | None = None, headers=()):
        body = raw if raw is not None else json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json" if raw is None else "text/html")
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.plan.models == "500":
            return self._send(500, {"error": {"message": "engine is dead"}})
        if self.plan.models == "nonjson":
            return self._send(200, raw=b"<html>It works!</html>")
        self._send(200, {"data": [{"id": "served-model"}]})

    def do_POST(self):
        plan = self.plan
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = body["messages"][-1]["content"]
        with plan.lock:
            plan.posts.append(key)
            plan.times.setdefault(key, []).append(time.monotonic())
            n, tries = len(plan.posts), plan.tries(key)
            plan.inflight += 1
            plan.max_inflight = max(plan.max_inflight, plan.inflight)
        try:
            self._act(plan.rule(n, key, tries), key)
        finally:
            with plan.lock:
                plan.inflight -= 1

    def _act(self, action, key):
        plan = self.plan
        if plan.hold_s:
            plan.stop.wait(plan.hold_s)
        if action == "ok":
            return self._send(200, {"choices": [{"message": {"role": "assistant", "content": f"re: {key}"}}]})
        if action == "int":
            return self._send(200, {"choices": [{"message": {"role": "assistant", "content": 42}}]})
        if action == "nonjson":
            return self._send(200, raw=b"<html>502 Bad Gateway</html>")
        if action == "reset":  # RST instead of a reply (SO_LINGER 0, closed at once)
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            os.close(self.connection.detach())
            self.close_connection = True
            return
        if action == "close":  # FIN without a reply
            self.close_connection = True
            return
        if action == "hang":
            plan.stop.wait(5)
            self.close_connection = True
            return
        if action == "trickle":  # headers, then a byte every 50 ms: no single read ever waits long
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "100000")
            self.end_headers()
            for _ in range(100):
                if plan.stop.wait(0.05):
                    break
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:
                    break
            self.close_connection = True
            return
        code, *extra = action  # (status, headers...)
        message = {400: "This model's maximum context length is 2048 tokens", 429: "slow down",
                   503: "server overloaded"}.get(code, "oops")
        self._send(code, {"error": {"message": message}}, headers=extra)


@pytest.fixture
def server():
    plan = Plan()
    httpd = Server(("127.0.0.1", 0), Handler)
    httpd.plan = plan
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    plan.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    yield plan
    plan.stop.set()  # hanging / trickling handlers return at once
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


def backend(tiny_target, url, **kw):
    cfg = dict(kind="openai", url=url, model="m", concurrency=2, timeout_s=2.0, retries=2, backoff_s=0.001,
               backoff_max_s=0.01)
    return make_backend(tiny_target, BackendConfig(**{**cfg, **kw}), SamplingParams(max_new_tokens=4))


def chat(b, *keys):
    return b.chat([[{"role": "user", "content": k}] for k in keys], [0] * len(keys))


def failed(answer) -> str:
    """The reason of a failed answer (it must not be text)."""
    assert answer is not None and not isinstance(answer, str), answer
    return str(answer)


# --- the backend: what is retried, and what is said when it still fails --------------------------

@pytest.mark.parametrize("action", [(503,), (500,), (502,), (429,), (408,), "reset", "close"])
def test_transient_failures_are_retried(tiny_target, server, action):
    server.rule = lambda n, key, tries: action if tries == 1 else "ok"
    assert chat(backend(tiny_target, server.url), "a", "b") == ["re: a", "re: b"]
    assert sorted(server.posts) == ["a", "a", "b", "b"]


def test_a_hang_past_timeout_is_retried(tiny_target, server):
    server.rule = lambda n, key, tries: "hang" if tries == 1 else "ok"
    t0 = time.monotonic()
    assert chat(backend(tiny_target, server.url, timeout_s=0.3), "a") == ["re: a"]
    assert server.tries("a") == 2 and time.monotonic() - t0 < 2


def test_retries_are_bounded_and_the_last_error_is_named(tiny_target, server):
    server.rule = lambda n, key, tries: (503,)
    [answer] = chat(backend(tiny_target, server.url, retries=3), "a")
    assert "HTTP 503" in failed(answer) and "server overloaded" in failed(answer)
    assert server.tries("a") == 4  # 1 + backend.retries


def test_retry_after_is_honoured_up_to_the_cap(tiny_target, server):
    server.rule = lambda n, key, tries: (429, ("Retry-After", "5")) if tries == 1 else "ok"
    assert chat(backend(tiny_target, server.url, backoff_max_s=0.3), "a") == ["re: a"]
    first, second = server.times["a"]
    assert 0.28 <= second - first < 2  # waited for Retry-After, but no longer than backend.backoff_max_s


def test_a_client_error_is_not_retried_and_names_the_server_message(tiny_target, server):
    server.rule = lambda n, key, tries: (400,)
    [answer] = chat(backend(tiny_target, server.url), "a")
    assert "HTTP 400" in failed(answer) and "maximum context length" in failed(answer)
    assert server.tries("a") == 1  # a bad request does not get better


def test_timeout_bounds_the_whole_request_when_the_server_trickles_bytes(tiny_target, server):
    server.rule = lambda n, key, tries: "trickle"
    t0 = time.monotonic()
    [answer] = chat(backend(tiny_target, server.url, timeout_s=0.5, retries=0), "a")
    assert time.monotonic() - t0 < 1.5
    assert "timed out after 0.5 s" in failed(answer)


def test_retries_keep_requests_in_flight(tiny_target, server):
    server.hold_s = 0.1
    server.rule = lambda n, key, tries: (429,) if tries == 1 else "ok"
    keys = [f"k{i}" for i in range(8)]
    assert chat(backend(tiny_target, server.url, concurrency=4), *keys) == [f"re: {k}" for k in keys]
    assert len(server.posts) == 16 and server.max_inflight >= 3


@pytest.mark.parametrize("models, says", [("500", "HTTP 500"), ("nonjson", "not JSON")])
def test_a_broken_models_list_is_one_sentence(tiny_target, server, models, says):
    server.models = models
    with pytest.raises(DraftsmithError, match=says) as e:
        backend(tiny_target, server.url, model=None)
    assert "backend.model" in str(e.value) and "\n" not in str(e.value)


def test_models_list_is_read_when_model_is_unset(tiny_target, server):
    b = backend(tiny_target, server.url, model=None)
    assert b.model == "served-model"


# --- the data-gen run: failures are reported, never recorded as done, and retried by a rerun --------

@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": 100 + i, "category": "c", "turns": [f"Q{i}?"]}) + "\n"
                            for i in range(16)))
    return str(path)


def data_gen(compose_cfg, questions, out, url, *extra):
    from draftsmith.data_gen.run import run

    return run(compose_cfg("data_gen", "target=tiny", "prompts=question", f"prompts.path={questions}",
                           "backend=openai", f"backend.url={url}", "backend.model=m", "backend.concurrency=1",
                           "backend.timeout_s=2", *FAST, "regenerate_chunk=4", "max_new_tokens=4", f"out={out}",
                           *extra))


def ids(out) -> list[str]:
    from draftsmith.data_gen.dataset import load_conversations

    return load_conversations(out)["id"]


ALL = [str(100 + i) for i in range(16)]


def test_a_server_failing_every_second_request_loses_no_sample(compose_cfg, questions, tmp_path, server):
    server.rule = lambda n, key, tries: (503,) if n % 2 == 0 else "ok"
    result = data_gen(compose_cfg, questions, tmp_path / "o", server.url)
    assert result["counts"]["samples"] == 16 and result["counts"]["failed"] == 0
    assert len(server.posts) == 31  # one at a time: 16 answers, every prompt but the first retried once
    assert ids(tmp_path / "o") == ALL


def test_failures_above_the_share_end_the_run_and_a_rerun_retries_only_them(compose_cfg, questions, tmp_path,
                                                                            server, caplog):
    bad = {"Q3?", "Q9?"}
    server.rule = lambda n, key, tries: (503,) if key in bad else "ok"
    out = tmp_path / "o"
    with pytest.raises(DraftsmithError) as e:
        data_gen(compose_cfg, questions, out, server.url, "backend.retries=2")
    msg = str(e.value)
    assert "2 of 16 prompts" in msg and "HTTP 503" in msg and "rerun" in msg and "\n" not in msg
    assert server.tries("Q3?") == server.tries("Q9?") == 3  # 1 + backend.retries
    err = caplog.text
    assert "prompt 3 (id 103)" in err and "prompt 9 (id 109)" in err  # each failed prompt, with its last error
    assert not (out / "manifest.json").exists()

    server.posts.clear()
    server.rule = lambda n, key, tries: "ok"  # the server recovered
    result = data_gen(compose_cfg, questions, out, server.url, "backend.retries=2")
    assert sorted(server.posts) == sorted(bad)  # only the failed prompts are asked again
    assert result["counts"]["samples"] == 16 and result["counts"]["failed"] == 0
    assert ids(out) == ALL


def test_failures_within_the_share_are_counted_and_still_retried_by_a_rerun(compose_cfg, questions, tmp_path,
                                                                             server):
    server.rule = lambda n, key, tries: "reset" if key == "Q5?" else "ok"
    out = tmp_path / "o"
    result = data_gen(compose_cfg, questions, out, server.url, "backend.retries=1", "backend.max_failed_share=0.1")
    assert result["counts"]["samples"] == 15 and result["counts"]["failed"] == 1
    assert "105" not in ids(out)

    server.posts.clear()
    server.rule = lambda n, key, tries: "ok"
    result = data_gen(compose_cfg, questions, out, server.url, "backend.retries=1", "backend.max_failed_share=0.1")
    assert server.posts == ["Q5?"]
    assert result["counts"]["samples"] == 16 and result["counts"]["failed"] == 0 and ids(out) == ALL


def test_ranks_retry_failed_prompts_of_a_finished_set(compose_cfg, questions, tmp_path, server, monkeypatch):
    out, allow = tmp_path / "o", ("backend.retries=0", "backend.max_failed_share=0.2")
    server.rule = lambda n, key, tries: (503,) if key in ("Q1?", "Q6?") else "ok"
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("0", "1"):  # rank 0 takes chunks 0, 2 (Q0-3, Q8-11), rank 1 chunks 1, 3
        monkeypatch.setenv("RANK", rank)
        result = data_gen(compose_cfg, questions, out, server.url, *allow)
    assert result["merged"] and result["counts"]["failed"] == 2 and "101" not in ids(out)

    server.posts.clear()
    server.rule = lambda n, key, tries: "ok"
    for rank in ("0", "1"):  # the finished set is not done: each rank asks again for its failed prompt
        monkeypatch.setenv("RANK", rank)
        result = data_gen(compose_cfg, questions, out, server.url, *allow)
    assert sorted(server.posts) == ["Q1?", "Q6?"]
    assert result["merged"] and result["counts"]["failed"] == 0 and ids(out) == ALL


def test_every_request_failing_says_why(compose_cfg, questions, tmp_path, server):
    server.rule = lambda n, key, tries: "hang"
    with pytest.raises(DraftsmithError) as e:
        data_gen(compose_cfg, questions, tmp_path / "o", server.url, "backend.retries=0", "backend.timeout_s=0.2",
                 "backend.concurrency=16", "backend.max_failed_share=1")
    assert "16 of 16 prompts" in str(e.value) and "timed out after 0.2 s" in str(e.value)


def test_a_server_that_is_gone_fails_fast(compose_cfg, questions, tmp_path):
    with socket.socket() as s:  # a free port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(DraftsmithError) as e:
        data_gen(compose_cfg, questions, tmp_path / "o", f"http://127.0.0.1:{port}/v1", "backend.retries=2",
                 "backend.backoff_s=0.2", "backend.backoff_max_s=0.2")
    assert time.monotonic() - t0 < 3  # one prompt's retries, not sixteen
    assert "16 of 16 prompts" in str(e.value) and "cannot connect" in str(e.value)
    assert "once the server is up" in str(e.value)


def test_a_reply_that_is_not_text_names_the_prompt(compose_cfg, questions, tmp_path, server):
    server.rule = lambda n, key, tries: "int" if key == "Q2?" else "ok"
    with pytest.raises(DraftsmithError) as e:
        data_gen(compose_cfg, questions, tmp_path / "o", server.url)
    msg = str(e.value)
    assert "prompt 2 (id 102)" in msg and "not text" in msg and "\n" not in msg
    assert server.tries("Q2?") == 1  # not retried


def test_a_reply_that_is_not_json_is_named(compose_cfg, questions, tmp_path, server):
    server.rule = lambda n, key, tries: "nonjson" if key == "Q0?" else "ok"
    with pytest.raises(DraftsmithError, match="not JSON"):
        data_gen(compose_cfg, questions, tmp_path / "o", server.url)


def test_cli_exits_2_with_one_sentence(questions, tmp_path, server, capsys, monkeypatch):
    from draftsmith.cli import main

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    server.rule = lambda n, key, tries: (503,)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["data-gen", "target=tiny", "prompts=question", f"prompts.path={questions}", "backend=openai",
              f"backend.url={server.url}", "backend.model=m", "backend.retries=1", "backend.concurrency=4", *FAST,
              "max_new_tokens=4", f"out={tmp_path / 'o'}"])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("draftsmith data-gen: error: 16 of 16 prompts") and "HTTP 503" in last
    assert "Traceback" not in last


# --- options and the retry helper ---------------------------------------------------------------

@pytest.mark.parametrize("override, says", [
    ("backend.retries=-1", "backend.retries=-1 must be at least 0"),
    ("backend.max_failed_share=1.5", "backend.max_failed_share=1.5 must be in [0, 1]"),
    ("backend.backoff_s=-1", "backend.backoff_s=-1"),
])
def test_bad_retry_options_are_one_sentence(compose_cfg, override, says):
    with pytest.raises(DraftsmithError, match=says.replace("[", r"\[").replace("]", r"\]")):
        compose_cfg("data_gen", "backend=openai", override)


def test_backoff_grows_with_jitter_honours_retry_after_and_is_capped():
    import random

    from draftsmith.core.retry import Backoff

    b = Backoff(retries=4, base_s=1.0, max_s=10.0)
    rng = random.Random(0)
    for retry in range(1, 8):
        for _ in range(50):
            d = b.delay(retry, rng=rng)
            top = min(10.0, 2.0 ** (retry - 1))
            assert top / 2 <= d <= top
    assert b.delay(1, retry_after=4.0, rng=rng) >= 4.0
    assert b.delay(1, retry_after=600.0, rng=rng) == 10.0


def test_retry_after_header_forms():
    from email.utils import formatdate

    from draftsmith.core.retry import retry_after_s

    assert retry_after_s("3") == 3.0
    assert retry_after_s(None) is None and retry_after_s("soon") is None and retry_after_s("-2") is None
    assert 8 <= retry_after_s(formatdate(time.time() + 10, usegmt=True)) <= 10.5


def test_retry_call_counts_and_raises_the_last_error():
    from draftsmith.core.retry import Backoff, Transient, call

    tries, slept = [], []

    def flaky():
        tries.append(1)
        if len(tries) < 3:
            raise Transient(f"HTTP 503 #{len(tries)}")
        return "done"

    assert call(flaky, Backoff(retries=4, base_s=0.001), sleep=slept.append) == "done"
    assert len(tries) == 3 and len(slept) == 2

    def always():
        tries.append(1)
        raise Transient(f"HTTP 503 #{len(tries)}")

    tries.clear()
    with pytest.raises(Transient, match="#3") as e:
        call(always, Backoff(retries=2, base_s=0.001), sleep=lambda s: None)
    assert e.value.attempts == 3 and len(tries) == 3
