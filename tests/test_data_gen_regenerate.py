"""Regeneration: batched HF backend (seeded, batch-independent, equal to HF generate) and the OpenAI backend."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from draftsmith.core import DraftsmithError
from draftsmith.data_gen.config import BackendConfig
from draftsmith.data_gen.regenerate import SamplingParams, generate_tokens, make_backend, regenerate, user_segments

PROMPTS = [[{"role": "user", "content": "hello " * k}] for k in range(1, 7)]


def chat_ids(target, conv):
    text = target.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    return target.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_greedy_equals_hf_generate(tiny_target):
    ids = [chat_ids(tiny_target, c) for c in PROMPTS[::2]]
    ours = generate_tokens(tiny_target, ids, SamplingParams(max_new_tokens=16), [0] * len(ids), batch_size=2)
    for x, (out, finish) in zip(ids, ours):
        ref = tiny_target.model.generate(torch.tensor([x]), max_new_tokens=16, do_sample=False)[0, len(x):].tolist()
        eos = tiny_target.eos_token_ids
        ref = ref[: next((i for i, t in enumerate(ref) if t in eos), len(ref))]
        assert out == ref and finish == ("length" if len(out) == 16 else "stop")


def test_sampling_reproducible_and_batch_independent(tiny_target):
    ids = [chat_ids(tiny_target, c) for c in PROMPTS[:4]]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=8)
    a = generate_tokens(tiny_target, ids, params, list(range(4)), batch_size=3)
    b = generate_tokens(tiny_target, ids, params, list(range(4)), batch_size=3)
    one = generate_tokens(tiny_target, ids, params, list(range(4)), batch_size=1, prune=False)
    c = generate_tokens(tiny_target, ids, params, [s + 100 for s in range(4)], batch_size=3)
    assert a == b == one
    assert a != c


def test_user_segments():
    s, u1, a1, u2 = ({"role": r, "content": r} for r in ("system", "user", "assistant", "user"))
    assert user_segments([s, u1, a1, u2]) == [[s, u1], [u2]]
    assert user_segments([s, u1, a1]) == [[s, u1]]
    assert user_segments([u1, u2]) == [[u1], [u2]]


class EchoBackend:
    """Answers with the number of messages it saw: shows what each turn was conditioned on."""

    def __init__(self):
        self.seen = []

    def chat(self, conversations, seeds):
        self.seen += conversations
        return [f"answer to {len(c)} messages" for c in conversations]


def test_multi_turn_conditions_on_regenerated_history():
    sample = {"id": "q", "category": "", "messages": [
        {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "old answer"},
        {"role": "user", "content": "Q2"}]}
    backend = EchoBackend()
    [out], failed = regenerate([sample], backend, seed=0)
    assert failed == 0
    assert [m["content"] for m in out["messages"]] == ["Q1", "answer to 1 messages", "Q2", "answer to 3 messages"]
    assert backend.seen[1][1]["content"] == "answer to 1 messages"  # never the source's answer


def test_hf_backend_multi_turn_seeded(tiny_target):
    samples = [{"id": str(i), "category": "", "messages": [{"role": "user", "content": f"q{i}"},
                                                            {"role": "user", "content": "more"}]} for i in range(2)]
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=6)
    backend = make_backend(tiny_target, BackendConfig(batch_size=2), params)
    a, _ = regenerate([dict(s) for s in samples], backend, seed=1)
    b, _ = regenerate([dict(s) for s in samples], backend, seed=1)
    assert a == b and [m["role"] for m in a[0]["messages"]] == ["user", "assistant", "user", "assistant"]


# --- the OpenAI-compatible backend against a local server ---------------------------------------

class FakeOpenAI(BaseHTTPRequestHandler):
    requests: list = []

    def log_message(self, *args):
        pass

    def _send(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, {"data": [{"id": "fake-model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.requests.append(body)
        last = body["messages"][-1]["content"]
        if last == "fail":
            return self._send(500, {"error": "boom"})
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": f"re: {last}"}}]})


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_openai_backend(tiny_target, fake_server):
    FakeOpenAI.requests = []
    samples = [{"id": str(i), "category": "", "messages": [{"role": "user", "content": c}, {"role": "user", "content": "x"}]}
               for i, c in enumerate(["a", "fail", "b"])]
    backend = make_backend(tiny_target, BackendConfig(kind="openai", url=fake_server, concurrency=2, retries=1,
                                                      backoff_s=0.001, backoff_max_s=0.01),
                           SamplingParams(max_new_tokens=5))
    out, failed = regenerate(samples, backend, seed=0)
    assert failed == 1 and [s["id"] for s in out] == ["0", "2"]
    assert sum(r["messages"][-1]["content"] == "fail" for r in FakeOpenAI.requests) == 2  # a 500 is tried again
    assert out[0]["messages"][1]["content"] == "re: a" and out[0]["messages"][3]["content"] == "re: x"
    assert {r["model"] for r in FakeOpenAI.requests} == {"fake-model"}
    assert all(r["max_tokens"] == 5 for r in FakeOpenAI.requests)


def test_openai_backend_unreachable(tiny_target):
    import socket

    with socket.socket() as s:  # a free port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DraftsmithError, match="cannot reach"):
        make_backend(tiny_target, BackendConfig(kind="openai", url=f"http://127.0.0.1:{port}/v1", timeout_s=5),
                     SamplingParams())
