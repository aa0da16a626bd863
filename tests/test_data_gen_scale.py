"""Data-gen at scale (issue 46): capture writes shards from a writer thread, byte for byte what a synchronous write
gives; the target asks from_pretrained for its device; the openai backend sends the next chunk's requests while
the last answers of a chunk are still out, and writes the same chunks in the same order.

Every server here is a loopback ThreadingHTTPServer its fixture shuts down; nothing waits longer than a
few seconds, and only when the behaviour under test is missing."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import save

from draftsmith.core import DraftsmithError
from draftsmith.core import artifacts as mf
from draftsmith.data_gen import capture as cap
from draftsmith.data_gen import regenerate as rg
from draftsmith.data_gen import target as tg
from draftsmith.data_gen.capture import capture_hidden_states, features_batch, shard_name
from draftsmith.data_gen.config import BackendConfig
from draftsmith.data_gen.target import TargetConfig, load_target

pytestmark = pytest.mark.timeout(120)

SEQS = [[(5 * i + j) % 250 for j in range(4 + 3 * i)] for i in range(7)]


# --- capture: a writer thread, the same bytes ---------------------------------------------------

def synchronous_shards(target, seqs, per_shard: int, batch_size: int, dtype=torch.bfloat16) -> dict[str, bytes]:
    """The shards as the synchronous capture (77bd05a) wrote them: same order, same batches, host copies, save()."""
    shards = {}
    for s in range(0, len(seqs), per_shard):
        order = sorted(range(s, min(s + per_shard, len(seqs))), key=lambda i: -len(seqs[i]))
        tensors = {}
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            for i, feats in zip(idx, features_batch(target, [seqs[i] for i in idx])):
                tensors[f"{i}.aux"] = feats["aux"].to(dtype).cpu().contiguous()
                tensors[f"{i}.last"] = feats["last"].to(dtype).cpu().contiguous()
                tensors[f"{i}.top"] = feats["top"].cpu().contiguous()
                tensors[f"{i}.lse"] = feats["lse"].cpu().contiguous()
        shards[shard_name(s // per_shard)] = save(tensors)
    return shards


def test_shards_are_written_off_the_main_thread_byte_identical_and_recorded_once_on_disk(tiny_target, tmp_path,
                                                                                          monkeypatch):
    writers, real_write, real_json = set(), cap._write_shard, cap.atomic_write_json

    def write(path, tensors):
        writers.add(threading.current_thread().name)
        return real_write(path, tensors)

    def index_written(path, obj):  # every shard an index lists is already on disk, whole
        for entry in obj["shards"]:
            assert (tmp_path / entry["file"]).stat().st_size == entry["bytes"], entry
        real_json(path, obj)

    monkeypatch.setattr(cap, "_write_shard", write)
    monkeypatch.setattr(cap, "atomic_write_json", index_written)
    index = capture_hidden_states(tiny_target, SEQS, tmp_path, samples_per_shard=2, batch_size=3)
    assert writers == {"capture-writer"}
    expected = synchronous_shards(tiny_target, SEQS, 2, 3)
    assert {p.name: p.read_bytes() for p in sorted(tmp_path.glob("shard_*"))} == expected
    assert [e["bytes"] for e in index["shards"]] == [len(expected[e["file"]]) for e in index["shards"]]


def test_the_target_computes_the_next_shard_while_one_is_written(tiny_target, tmp_path, monkeypatch):
    next_forward, real_features, real_write = threading.Event(), cap.features_batch, cap._write_shard
    overlapped = []

    def features(target, batch, *a):
        if any(x is SEQS[2] for x in batch):  # shard 1's first forward
            next_forward.set()
        return real_features(target, batch, *a)

    def write(path, tensors):
        if path.name == shard_name(0):  # hold shard 0's write until shard 1 is computed (synchronous: never)
            overlapped.append(next_forward.wait(5))
        return real_write(path, tensors)

    monkeypatch.setattr(cap, "features_batch", features)
    monkeypatch.setattr(cap, "_write_shard", write)
    capture_hidden_states(tiny_target, SEQS, tmp_path, samples_per_shard=2, batch_size=2)
    assert overlapped == [True]


def test_a_writer_error_is_one_error_in_the_caller_and_a_rerun_finishes(tiny_target, tmp_path, monkeypatch):
    full = tmp_path / "full"
    capture_hidden_states(tiny_target, SEQS, full, samples_per_shard=2, batch_size=3)
    real = cap.atomic_write_bytes

    def disk_full(path, data):
        if path.name == shard_name(1):
            raise OSError(28, "No space left on device")
        return real(path, data)

    part = tmp_path / "part"
    monkeypatch.setattr(cap, "atomic_write_bytes", disk_full)
    with pytest.raises(DraftsmithError) as e:
        capture_hidden_states(tiny_target, SEQS, part, samples_per_shard=2, batch_size=3)
    msg = str(e.value)
    assert shard_name(1) in msg and "No space left on device" in msg and "\n" not in msg
    assert [s["file"] for s in json.loads((part / "index.json").read_text())["shards"]] == [shard_name(0)]
    assert not (part / shard_name(1)).exists()

    monkeypatch.setattr(cap, "atomic_write_bytes", real)
    capture_hidden_states(tiny_target, SEQS, part, samples_per_shard=2, batch_size=3)
    assert {p.name: p.read_bytes() for p in part.glob("shard_*")} == {p.name: p.read_bytes() for p in full.glob("shard_*")}
    assert (part / "index.json").read_text() == (full / "index.json").read_text()


def test_host_copies_are_plain_tensors_on_a_cpu():
    t = torch.arange(6.0).reshape(2, 3)[:, :2]
    host = cap.to_host(t)
    assert host.is_contiguous() and torch.equal(host, t) and not host.is_pinned()
    assert cap.host_ready(torch.device("cpu")) is None


# --- the target: loaded onto its device -----------------------------------------------------------

class Asked(Exception):
    pass


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, tiny_target):
    folder = tmp_path_factory.mktemp("scale") / "tiny-hf"
    tiny_target.model.save_pretrained(folder)
    tiny_target.tokenizer.save_pretrained(folder)
    return folder


def gguf_in_cache(tmp_path, hf_folder, monkeypatch) -> str:
    """A .gguf file whose dequantised copy is already in the cache (what _load_gguf loads the weights from)."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF not read: its cached copy is")
    shutil.copytree(hf_folder, tg.cache_root() / "targets" / f"m-{tg.file_sha256(path)[:16]}")
    return str(path)


@pytest.mark.parametrize("kind", ["hf", "gguf"])
@pytest.mark.parametrize("device", ["cuda:1", "cpu"])
def test_the_weights_load_straight_onto_the_device(kind, device, hf_folder, tmp_path, monkeypatch):
    name = str(hf_folder) if kind == "hf" else gguf_in_cache(tmp_path, hf_folder, monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (only from_pretrained's arguments are read)
    calls = []

    def from_pretrained(*a, **kw):
        calls.append(kw)
        raise Asked

    target = load_target(TargetConfig(name=name, device=device, dtype="float32"), lazy=True)
    monkeypatch.setattr(tg.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(Asked):
        target.model  # noqa: B018
    [kw] = calls
    assert kw["dtype"] == torch.float32
    if device == "cpu":
        assert "device_map" not in kw  # as before: the CPU load is unchanged
    else:
        assert kw["device_map"] == device


# --- the openai backend: in flight across chunk boundaries -----------------------------------------

class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args):
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({"data": [{"id": "m"}]})

    def do_POST(self):
        plan = self.server.plan
        key = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["messages"][-1]["content"]
        with plan["lock"]:
            plan["events"].append(("post", key))
            plan["inflight"] += 1
            plan["max_inflight"] = max(plan["max_inflight"], plan["inflight"])
            if key in plan["next"]:
                plan["next_started"].set()
        if key == plan["slow"]:  # the slowest answer: held until the next chunk's first request came (or 5 s)
            plan["next_started"].wait(5)
        with plan["lock"]:
            plan["events"].append(("answer", key))
            plan["inflight"] -= 1
        self._send({"choices": [{"message": {"role": "assistant", "content": f"re: {key}"}}]})


@pytest.fixture
def server():
    plan = {"lock": threading.Lock(), "events": [], "inflight": 0, "max_inflight": 0, "slow": None, "next": set(),
            "next_started": threading.Event()}
    httpd = Server(("127.0.0.1", 0), Handler)
    httpd.plan = plan
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    plan["url"] = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    yield plan
    plan["next_started"].set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


QUESTIONS = [f"Q{i}?" for i in range(16)]  # 4 chunks of 4


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": 100 + i, "category": "c", "turns": [q]}) + "\n"
                            for i, q in enumerate(QUESTIONS)))
    return str(path)


def data_gen(compose_cfg, questions, out, url, *extra):
    from draftsmith.data_gen.run import run

    return run(compose_cfg("data_gen", "target=tiny", "prompts=question", f"prompts.path={questions}",
                           "backend=openai", f"backend.url={url}", "backend.model=m", "backend.concurrency=4",
                           "backend.timeout_s=10", "regenerate_chunk=4", "max_new_tokens=4", f"out={out}", *extra))


def written(out) -> tuple[list, dict]:
    from draftsmith.data_gen.dataset import load_conversations

    chunks = {p.name: json.loads(p.read_text())["messages"] for p in sorted((out / "regenerated").glob("chunk_*.json"))}
    return load_conversations(out).to_list(), chunks


def test_the_default_keeps_hundreds_of_requests_in_flight(compose_cfg):
    assert BackendConfig().concurrency == 256
    assert compose_cfg("data_gen", "backend=openai").backend.concurrency == 256


def test_the_next_chunk_is_asked_for_before_the_slowest_answer_returns(compose_cfg, questions, tmp_path, server,
                                                                       monkeypatch):
    server["slow"], server["next"] = "Q1?", set(QUESTIONS[4:8])
    data_gen(compose_cfg, questions, tmp_path / "piped", server["url"])
    events = server["events"]
    first_next = min(events.index(("post", q)) for q in QUESTIONS[4:8])
    assert first_next < events.index(("answer", "Q1?"))  # chunk 1 went out while chunk 0 still waited
    assert server["max_inflight"] <= 4  # backend.concurrency bounds every chunk's requests together

    server["slow"] = None  # the same run one chunk at a time (the loop before issue 46)
    monkeypatch.setattr(rg, "jobs_at_once", lambda backend, size: 1)
    data_gen(compose_cfg, questions, tmp_path / "serial", server["url"])
    piped, serial = written(tmp_path / "piped"), written(tmp_path / "serial")
    assert piped == serial
    assert [c["messages"][-1]["content"] for c in piped[0]] == [f"re: {q}" for q in QUESTIONS]


def test_a_run_killed_while_chunks_overlap_resumes_from_its_written_chunks(compose_cfg, questions, tmp_path, server,
                                                                          monkeypatch, caplog):
    data_gen(compose_cfg, questions, tmp_path / "whole", server["url"])
    real = mf.atomic_write_bytes

    def killed_at_chunk_2(path, data):
        if str(path).endswith("chunk_00002.json"):
            raise KeyboardInterrupt("killed")
        return real(path, data)

    monkeypatch.setattr(mf, "atomic_write_bytes", killed_at_chunk_2)
    with pytest.raises(KeyboardInterrupt):
        data_gen(compose_cfg, questions, tmp_path / "killed", server["url"])
    monkeypatch.setattr(mf, "atomic_write_bytes", real)
    assert sorted(p.name for p in (tmp_path / "killed" / "regenerated").glob("chunk_*")) == \
        ["chunk_00000.json", "chunk_00001.json"]

    server["events"].clear()
    caplog.set_level(logging.INFO, logger="draftsmith")
    data_gen(compose_cfg, questions, tmp_path / "killed", server["url"])
    assert "reusing 8 of 16 prompts already regenerated" in caplog.text
    assert sorted(key for kind, key in server["events"] if kind == "post") == sorted(QUESTIONS[8:])
    assert written(tmp_path / "killed") == written(tmp_path / "whole")


def test_an_error_in_a_chunk_is_raised_once_and_stops_further_requests():
    class Backend:
        slots = 4

        def __init__(self):
            self.asked, self.stopped = [], None

        def stop(self, why):
            self.stopped = why

        def chat(self, conversations, seeds, done=None):
            if self.stopped:
                return [rg.Failed(self.stopped, 0)] * len(conversations)
            self.asked += [c[-1]["content"] for c in conversations]
            if conversations[0][-1]["content"] == "c1":
                time.sleep(0.05)
                raise DraftsmithError("the server said no.")
            return ["ok"] * len(conversations)

    backend, handed = Backend(), []
    jobs = [[{"id": str(k), "messages": [{"role": "user", "content": f"c{k}"}]}] for k in range(20)]
    with pytest.raises(DraftsmithError, match="the server said no"):
        rg.regenerate_in_order(jobs, backend, 0, lambda k, messages, errors: handed.append(k))
    assert handed == [0] and backend.stopped
    assert len(backend.asked) < len(jobs)  # the window, not every chunk, was asked for
