"""data-gen resume (kill -9 mid-regeneration, changed settings), the output lock, and progress lines."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from draftsmith.core import DraftsmithError
from draftsmith.core import artifacts as mf
from draftsmith.data_gen import chunks, ranks, sets
from draftsmith.data_gen import run as dg
from draftsmith.data_gen.dataset import load_conversations, load_tokenized

QUESTIONS = [{"question_id": 200 + i, "category": "c", "turns": [f"Question {i}?"] + (["Why?"] if i % 2 else [])}
             for i in range(5)]


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return str(path)


def argv(questions, out, *extra):
    return ["target=tiny", "prompts=question", f"prompts.path={questions}", "max_new_tokens=6", "temperature=0",
            "regenerate_chunk=1", f"out={out}", *extra]


def outputs(out):
    return load_conversations(out).to_list(), load_tokenized(out)[0].to_list()


def count_regenerated(monkeypatch) -> list:
    """Record the size of every chunk data-gen regenerates."""
    calls, real = [], chunks.regenerate_all
    monkeypatch.setattr(chunks, "regenerate_all", lambda chunk, *a, **k: calls.append(len(chunk)) or real(chunk, *a, **k))
    return calls


# A data-gen that finishes chunks 0 and 1, then hangs in chunk 2 until it is killed.
CHILD = """
import sys, time
import draftsmith.data_gen.chunks as chunks
real, n = chunks.regenerate_all, [0]
def slow(*a, **k):
    n[0] += 1
    if n[0] == 3:
        time.sleep(600)
    return real(*a, **k)
chunks.regenerate_all = slow
from draftsmith.cli import main
main(["data-gen", *sys.argv[1:]])
"""


def test_killed_data_gen_resumes_its_regeneration(compose_cfg, questions, tmp_path, monkeypatch, caplog):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    dg.run(compose_cfg("data_gen", *argv(questions, whole)))

    child = subprocess.Popen([sys.executable, "-c", CHILD, *argv(questions, killed)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    done = killed / dg.REGEN / "chunk_00001.json"
    deadline = time.monotonic() + 180
    while not done.is_file():
        assert child.poll() is None, child.stderr.read().decode()
        assert time.monotonic() < deadline, "the child data-gen never finished two chunks"
        time.sleep(0.2)
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stderr.close()
    kept = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (killed / dg.REGEN).glob("chunk_*.json")}
    assert sorted(kept) == ["chunk_00000.json", "chunk_00001.json"]
    assert not (killed / "manifest.json").exists()
    assert json.loads((killed / ranks.LOCK).read_text())["pid"] == child.pid  # left behind by the kill: stale

    calls = count_regenerated(monkeypatch)
    caplog.set_level(logging.INFO, logger="draftsmith")
    dg.run(compose_cfg("data_gen", *argv(questions, killed)))
    assert "reusing 2 of 5 prompts already regenerated" in caplog.text
    assert calls == [1, 1, 1]  # only chunks 2, 3, 4
    assert {n: (p.stat().st_ino, p.stat().st_mtime_ns) for n, p in
            ((n, killed / dg.REGEN / n) for n in kept)} == kept  # finished chunks untouched
    assert outputs(killed) == outputs(whole)
    assert json.loads((killed / "manifest.json").read_text())["counts"] == \
        json.loads((whole / "manifest.json").read_text())["counts"]
    assert not (killed / ranks.LOCK).exists()


def test_only_what_a_setting_affects_is_redone(compose_cfg, questions, tmp_path, monkeypatch, capfd):
    out = tmp_path / "o"
    dg.run(compose_cfg("data_gen", *argv(questions, out, "hidden_states=true", "samples_per_shard=2")))
    conv, tok = outputs(out)
    shards = {p.name: p.stat().st_mtime_ns for p in (out / "hidden_states").glob("shard_*")}
    calls = count_regenerated(monkeypatch)

    # capture settings: nothing regenerated or retokenized, shards kept
    dg.run(compose_cfg("data_gen", *argv(questions, out, "hidden_states=true", "samples_per_shard=2",
                                         "capture_batch_size=3")))
    assert calls == [] and outputs(out) == (conv, tok)
    assert {p.name: p.stat().st_mtime_ns for p in (out / "hidden_states").glob("shard_*")} == shards
    assert "capture_batch_size: 3" in (out / "config.yaml").read_text()

    # tokenization settings: retokenized from the saved answers, nothing regenerated
    dg.run(compose_cfg("data_gen", *argv(questions, out, "max_length=40")))
    assert calls == []
    assert all(len(r["input_ids"]) <= 40 for r in load_tokenized(out)[0]) and load_conversations(out).to_list() == conv
    assert not (out / "hidden_states").exists()

    # a regeneration setting: everything regenerated
    dg.run(compose_cfg("data_gen", *argv(questions, out, "max_new_tokens=4")))
    assert calls == [1] * 5

    # fewer prompts: the chunks beyond them go
    dg.run(compose_cfg("data_gen", *argv(questions, out, "max_new_tokens=4", "prompts.n=2")))
    assert calls == [1] * 5 and sorted(p.name for p in (out / dg.REGEN).iterdir()) == \
        ["chunk_00000.json", "chunk_00001.json"]


def test_a_corrupt_chunk_is_regenerated(compose_cfg, questions, tmp_path, monkeypatch):
    out = tmp_path / "o"
    dg.run(compose_cfg("data_gen", *argv(questions, out)))
    before = outputs(out)
    (out / dg.REGEN / "chunk_00003.json").write_text('{"key": "trunc')
    (out / sets.KEY).unlink()  # as if the run had died before tokenizing
    calls = count_regenerated(monkeypatch)
    dg.run(compose_cfg("data_gen", *argv(questions, out)))
    assert calls == [1] and outputs(out) == before


def test_a_live_lock_refuses_a_second_run(compose_cfg, questions, tmp_path):
    out = mf.claim_output(tmp_path / "o", "data_gen")  # a data-gen folder, as a running one is
    (out / ranks.LOCK).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    with pytest.raises(DraftsmithError, match=r"another data-gen \(pid \d+ on .*\) is writing to") as e:
        dg.run(compose_cfg("data_gen", *argv(questions, out)))
    assert "\n" not in str(e.value) and str(out / ranks.LOCK) in str(e.value)
    assert not (out / "conversations").exists() and (out / ranks.LOCK).exists()  # nothing done, lock kept


def test_a_stale_lock_is_taken_over(compose_cfg, questions, tmp_path):
    out = mf.claim_output(tmp_path / "o", "data_gen")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (out / ranks.LOCK).write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname()}))
    dg.run(compose_cfg("data_gen", *argv(questions, out, "prompts.n=1")))
    assert (out / "manifest.json").is_file() and not (out / ranks.LOCK).exists()


def test_progress_lines_when_not_a_terminal(compose_cfg, questions, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DRAFTSMITH_PROGRESS_INTERVAL", "0")
    caplog.set_level("INFO", logger="draftsmith.core.progress")  # progress lines are logged (the CLI shows them)
    dg.run(compose_cfg("data_gen", *argv(questions, tmp_path / "o", "prompts.n=4", "hidden_states=true")))
    err = "\n".join(r.getMessage() for r in caplog.records if r.name == "draftsmith.core.progress")
    assert "regenerate: 1/4 (25%)" in err and "regenerate: 4/4 (100%)" in err
    assert "capture: " in err and "(100%)" in err.split("capture: ")[-1]
