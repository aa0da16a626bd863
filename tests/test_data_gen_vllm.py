"""data-gen's backend=vllm: the worker (core/vllm_generate.py) against a stand-in `vllm` package (fast), and
one slow test in the real engine, where vLLM's greedy answers must equal the hf backend's in fp32 up to near-ties.

The stand-in answers each prompt with its last 4 tokens and the first stop id, finishes the requests last-added
first (out of order), and records what it was given (the LLM's settings, every request's prompt and sampling) in
$STANDIN_RECORD, one JSON line per LLM built.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

from draftsmith.core import DraftsmithError, engine
from draftsmith.data_gen import run as dg
from draftsmith.data_gen.config import BackendConfig
from draftsmith.data_gen.dataset import load_conversations, load_tokenized
from draftsmith.data_gen.regenerate import SamplingParams, make_backend, prompt_ids
from draftsmith.data_gen.target import TargetConfig, load_target, tiny_model_config, tiny_tokenizer

FAKE_VLLM = '''
import json, os, types
__version__ = "0.0-standin"

class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)

def TokensPrompt(prompt_token_ids):
    return {"prompt_token_ids": prompt_token_ids}

class LLM:
    def __init__(self, model, **kw):
        if kw.get("dtype") == "float16":
            raise ValueError("float16 is not\\nsupported on CPU")
        self.record = {"llm": {"model": model, **kw}, "requests": []}
        self.waiting = []
        self.llm_engine = types.SimpleNamespace(add_request=self.add_request, step=self.step,
                                                has_unfinished_requests=lambda: bool(self.waiting),
                                                engine_core=types.SimpleNamespace(shutdown=self.shutdown))

    def add_request(self, request_id, prompt, params):
        self.record["requests"].append({"id": request_id, "prompt": prompt["prompt_token_ids"], "params": vars(params)})
        self.waiting.append((request_id, prompt["prompt_token_ids"], params))

    def step(self):
        rid, ids, params = self.waiting.pop()
        tokens = (ids[-4:] + params.stop_token_ids[:1])[: params.max_tokens]
        return [types.SimpleNamespace(request_id=rid, finished=True, outputs=[types.SimpleNamespace(token_ids=tokens)])]

    def shutdown(self):
        with open(os.environ["STANDIN_RECORD"], "a") as f:
            f.write(json.dumps(self.record) + "\\n")
'''

FAKE_PLATFORMS = '''
import types
current_platform = types.SimpleNamespace(is_cpu=lambda: True)
'''

FAKE_SAMPLING = '''
class RequestOutputKind:
    FINAL_ONLY = 2
'''


@pytest.fixture
def standin_engine(tmp_path, monkeypatch):
    """A python whose `vllm` is the stand-in above; returns the file it records into."""
    site = tmp_path / "site"
    (site / "vllm" / "platforms").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    (site / "vllm" / "platforms" / "__init__.py").write_text(textwrap.dedent(FAKE_PLATFORMS))
    (site / "vllm" / "sampling_params.py").write_text(textwrap.dedent(FAKE_SAMPLING))
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv(engine.PYTHON_ENV, str(python))
    monkeypatch.setenv("STANDIN_RECORD", str(record))
    return record


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny target as an HF folder without weights (config.json and tokenizer): what vLLM would load."""
    folder = tmp_path_factory.mktemp("tiny_folder")
    tok = tiny_tokenizer()
    config = tiny_model_config(len(tok))
    config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    tok.save_pretrained(folder)
    config.save_pretrained(folder)
    return str(folder)


CONVERSATIONS = [[{"role": "user", "content": f"Question {i}?"}] for i in range(5)]
SEEDS = [101, 102, 103, 104, 105]


def standin_answer(tok, ids: list[int], eos: list[int]) -> str:
    return tok.decode(ids[-4:] + eos[:1], skip_special_tokens=True)


def test_vllm_backend_sends_the_hf_prompt_tokens_and_never_loads_the_weights(standin_engine, tiny_folder):
    target = load_target(TargetConfig(name=tiny_folder), lazy=True)
    backend = make_backend(target, BackendConfig(kind="vllm", batch_size=3), SamplingParams(max_new_tokens=8),
                           dtype="float32")
    done: list[int] = []
    answers = backend.chat(CONVERSATIONS, SEEDS, done=done.append)

    tok, eos = target.tokenizer, target.eos_token_ids
    ids = [tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
           ["input_ids"] for c in CONVERSATIONS]
    assert prompt_ids(tok, CONVERSATIONS) == ids  # the one rendering both backends use
    assert answers == [standin_answer(tok, x, eos) for x in ids]  # in order, though finished last-first
    assert sorted(done) == list(range(5))  # each answer reported once
    assert not target.model_loaded
    (run,) = records(standin_engine)  # one LLM for every conversation
    llm = run["llm"]
    assert llm["model"] == tiny_folder and llm["dtype"] == "float32" and llm["max_num_seqs"] == 3
    assert llm["max_model_len"] == max(map(len, ids)) + 8 and llm["kv_cache_memory_bytes"] > 0
    assert [r["prompt"] for r in run["requests"]] == ids
    for r in run["requests"]:
        assert r["params"] == {"temperature": 0.0, "max_tokens": 8, "stop_token_ids": eos, "detokenize": False,
                               "output_kind": 2}  # FINAL_ONLY
    assert backend.last_run["ok"] and backend.last_run["load_s"] >= 0


def test_sampled_requests_carry_their_own_seeds(standin_engine, tiny_folder):
    target = load_target(TargetConfig(name=tiny_folder), lazy=True)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=8)
    make_backend(target, BackendConfig(kind="vllm"), params, dtype="float32").chat(CONVERSATIONS, SEEDS)
    (run,) = records(standin_engine)
    got = [(r["params"]["seed"], r["params"]["temperature"], r["params"]["top_p"], r["params"]["top_k"])
           for r in run["requests"]]
    assert got == [(s, 0.7, 0.9, 20) for s in SEEDS]


def test_data_gen_with_backend_vllm(standin_engine, tiny_folder, compose_cfg, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [f"Question {i}?"]}) + "\n"
                                 for i in range(4)))
    out = tmp_path / "out"
    cfg = compose_cfg("data_gen", f"target.name={tiny_folder}", "target.dtype=float32", "prompts=question",
                      f"prompts.path={questions}", "backend=vllm", "backend.batch_size=2", "max_new_tokens=6",
                      "temperature=0", f"out={out}")
    assert dg.run(cfg)["counts"]["samples"] == 4
    target = load_target(TargetConfig(name=tiny_folder), lazy=True)
    tok, eos = target.tokenizer, target.eos_token_ids
    (run,) = records(standin_engine)
    assert run["llm"]["max_num_seqs"] == 2
    expected = [standin_answer(tok, r["prompt"], eos) for r in run["requests"]]
    rows = load_conversations(out).to_list()
    assert [row["messages"][-1]["content"] for row in rows] == expected
    assert dg.regeneration_settings(cfg, target.identity())["batch_size"] == 2  # in the chunks' key


def test_missing_engine_is_one_sentence(monkeypatch, tmp_path, tiny_folder):
    monkeypatch.setattr(engine, "engine_python", lambda: None)  # no .venv-vllm, no vllm here
    target = load_target(TargetConfig(name=tiny_folder), lazy=True)
    with pytest.raises(DraftsmithError) as e:
        make_backend(target, BackendConfig(kind="vllm"), SamplingParams(), dtype="float32")
    assert str(e.value) == "backend=vllm: vLLM not installed (bash scripts/setup.sh --engine)."
    monkeypatch.undo()
    monkeypatch.setenv(engine.PYTHON_ENV, str(tmp_path / "nope" / "python"))
    with pytest.raises(DraftsmithError, match=r"^backend=vllm: vLLM not installed: .*nope/python does not exist"):
        make_backend(target, BackendConfig(kind="vllm"), SamplingParams(), dtype="float32")


def test_refusals_are_one_sentence(standin_engine, tiny_folder, tiny_target):
    with pytest.raises(DraftsmithError, match="needs a target vLLM can load.*target.name=tiny"):
        make_backend(tiny_target, BackendConfig(kind="vllm"), SamplingParams(), dtype="float32")
    target = load_target(TargetConfig(name=tiny_folder), lazy=True)
    backend = make_backend(target, BackendConfig(kind="vllm"), SamplingParams(max_new_tokens=4), dtype="float16")
    with pytest.raises(DraftsmithError, match=r"vLLM could not generate .*\(ValueError: float16 is not supported "
                                              r"on CPU\)\.$"):
        backend.chat(CONVERSATIONS, SEEDS)


def test_backend_kind_vllm_is_a_choice():
    assert BackendConfig(kind="vllm").kind == "vllm"
    with pytest.raises(DraftsmithError, match="vllm"):
        BackendConfig(kind="vlm")


# --------------------------------------------------------------------------- the real engine (slow)

TIE = 1e-4  # a near tie: the two tokens are the HF logits' top 2 and their gap is below TIE * |top logit|
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion in one sentence.",
             "Name three primary colours.", "How do I boil an egg?", "What is 12 times 7?"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_vllm_answers_equal_hf_answers_greedy_fp32(engine_ready, compose_cfg, tmp_path, request):
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [q]}) + "\n"
                                 for i, q in enumerate(QUESTIONS)))
    common = ["target=smollm2", "target.dtype=float32", "prompts=question", f"prompts.path={questions}",
              "max_new_tokens=48", "temperature=0", "backend.batch_size=6"]
    rows = {}
    for kind in ("hf", "vllm"):
        dg.run(compose_cfg("data_gen", *common, f"backend={kind}", f"out={tmp_path / kind}"))
        rows[kind] = load_tokenized(tmp_path / kind)[0].to_list()
    assert [r["id"] for r in rows["hf"]] == [r["id"] for r in rows["vllm"]] and len(rows["hf"]) == len(QUESTIONS)
    differ = [(a["input_ids"], b["input_ids"]) for a, b in zip(rows["hf"], rows["vllm"])
              if a["input_ids"] != b["input_ids"]]
    if not differ:
        return
    target = request.getfixturevalue("smollm2_target")  # (fp32)
    for a, b in differ:
        k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # (the rows end alike: <|im_end|>, newline)
        with torch.inference_mode():
            logits = target.model(torch.tensor([a[:k]])).logits[0, -1].double()
        top = logits.topk(2)
        gap = float(top.values[0] - top.values[1])
        assert {a[k], b[k]} == set(top.indices.tolist()) and gap < TIE * abs(float(top.values[0])), (
            f"first difference at token {k}: hf {a[k]} vs vllm {b[k]}, top-2 {top.indices.tolist()} gap {gap:.3g}")
