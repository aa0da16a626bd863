"""Targets without their weights: load_target(lazy=True) knows the tokenizer and identity (the same as a full
load), and data-gen with backend=openai and no hidden states never builds the model."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from draftsmith.data_gen import target as tg
from draftsmith.data_gen.target import TargetConfig, load_target


def no_weights(monkeypatch):
    """Make every way of building a model fail."""
    def refuse(*a, **k):
        raise AssertionError("the target's weights were loaded")

    import transformers

    monkeypatch.setattr(tg.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.LlamaForCausalLM, "__init__", refuse)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, tiny_target):
    folder = tmp_path_factory.mktemp("hf") / "tiny-hf"
    tiny_target.model.save_pretrained(folder)
    tiny_target.tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("name", ["tiny", "hf"])
def test_lazy_identity_equals_a_full_load(name, hf_folder, monkeypatch):
    cfg = TargetConfig(name=hf_folder if name == "hf" else name)
    full = load_target(cfg)
    no_weights(monkeypatch)
    lazy = load_target(cfg, lazy=True)
    assert lazy.identity() == full.identity()
    assert lazy.eos_token_ids == full.eos_token_ids and lazy.tokenizer.pad_token_id == full.tokenizer.pad_token_id
    assert not lazy.model_loaded
    with pytest.raises(AssertionError, match="weights were loaded"):
        lazy.model  # noqa: B018
    monkeypatch.undo()
    assert lazy.model is not None and lazy.model_loaded  # loaded on first use, the same model
    assert all(torch.equal(a, b) for a, b in zip(lazy.model.state_dict().values(), full.model.state_dict().values()))
    assert lazy.eos_token_ids == full.eos_token_ids


@pytest.mark.slow
def test_lazy_gguf_identity_equals_a_full_load(smollm2_target, monkeypatch):
    no_weights(monkeypatch)
    lazy = load_target(TargetConfig(name="smollm2"), lazy=True)
    assert lazy.identity() == smollm2_target.identity() and lazy.eos_token_ids == smollm2_target.eos_token_ids


class Echo(BaseHTTPRequestHandler):
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
        self._send({"data": [{"id": "served"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send({"choices": [{"message": {"role": "assistant", "content": "re: " + body["messages"][-1]["content"]}}]})


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def test_openai_backend_without_hidden_states_never_loads_the_weights(compose_cfg, hf_folder, server, tmp_path,
                                                                       monkeypatch):
    from draftsmith.data_gen.dataset import load_tokenized
    from draftsmith.data_gen.run import run

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "turns": [f"Q{i}?"]}) + "\n" for i in range(3)))
    full_target = load_target(TargetConfig(name=hf_folder))
    full, eos = full_target.identity(), set(full_target.eos_token_ids)
    no_weights(monkeypatch)
    out = tmp_path / "o"
    result = run(compose_cfg("data_gen", "target=hf", f"target.name={hf_folder}", "prompts=question",
                             f"prompts.path={questions}", "backend=openai", f"backend.url={server}", f"out={out}"))
    assert result["counts"]["samples"] == 3
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == full  # the same identity as a full load: train accepts this data
    ds, _ = load_tokenized(out, full)
    for row in ds:  # the end-of-turn token (from the generation config) ends the assistant turn, in the loss
        assert [m for t, m in zip(row["input_ids"], row["loss_mask"]) if t in eos][-1] == 1
