"""`draftsmith publish` against a Hub that fails: a loopback fake Hub (127.0.0.1, port 0, shut down after each
test) answering 500, 401, never answering, or creating the repo and then refusing the commit; a closed port; and
HF_HUB_OFFLINE=1. Each is one sentence (what failed, what exists on the Hub, how to retry), exit code 2, no
traceback, within short timeouts. And what publish uploads holds no local path and nothing reached through a link."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers import eval_cfg, save_tiny_head

from draftsmith.cli import main

REPO = "someone/tiny-eagle3"
TOKEN = "hf_draftsmithTestTokenNeverShown0123"
COMMON = [f"repo_id={REPO}", "base_model=someone/tiny-base", "license=mit", "allow_no_eval=true", "hub_timeout=2"]


class FakeHub:
    """An HTTP server on a free loopback port: `mode` decides every answer; `requests` records the paths asked."""

    def __init__(self, mode: str):
        self.mode, self.requests, self.release = mode, [], threading.Event()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                hub.requests.append(self.path)
                if hub.mode == "hang":
                    hub.release.wait(30)
                    return
                if hub.mode == "commit-403" and self.path == "/api/repos/create":
                    return self.reply(200, {"url": f"{hub.url}/{REPO}", "name": REPO})
                status = {"500": 500, "401": 401, "commit-403": 403}[hub.mode]
                self.reply(status, {"error": {500: "Internal Error", 401: "Invalid credentials in Authorization header",
                                              403: "You have no write access to someone"}[status]})

            def reply(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_HEAD = answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there once the socket is closed


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return Path(save_tiny_head(tmp_path_factory.mktemp("hub-errors") / "head"))


@pytest.fixture
def hub(request, monkeypatch):
    """hub(mode): a FakeHub huggingface_hub talks to (HF_ENDPOINT and the endpoint it read at import), closed after."""
    from huggingface_hub import constants

    def start(mode):
        fake = FakeHub(mode)
        request.addfinalizer(fake.close)
        point_at(fake.url)
        return fake

    def point_at(url):
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setattr(constants, "ENDPOINT", url)

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() hands its overrides to Hydra through sys.argv
    start.point_at = point_at
    return start


def refused(capsys, *argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["publish", *argv])
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert "Traceback" not in err and TOKEN not in err, err
    assert e.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("draftsmith publish: error: "), err
    return lines[0]


@pytest.mark.parametrize("mode,said", [("500", "HTTP 500 (Internal Error)"),
                                       ("401", "HTTP 401 (Invalid credentials in Authorization header)")])
def test_a_failing_hub_is_one_sentence(head, tmp_path, hub, capsys, mode, said):
    fake = hub(mode)
    line = refused(capsys, f"head={head}", *COMMON, f"out={tmp_path / 'hub'}")
    assert f"could not create the repo {REPO} on {fake.url}" in line and said in line
    assert "nothing was created or uploaded on the Hub" in line and "rerun the same command" in line
    assert "/api/repos/create" in fake.requests and not [r for r in fake.requests if "commit" in r or "preupload" in r]
    if mode == "401":
        assert "HF_TOKEN" in line and "write access" in line


def test_repo_created_but_commit_refused_says_what_exists(head, tmp_path, hub, capsys):
    fake = hub("commit-403")
    line = refused(capsys, f"head={head}", *COMMON, f"out={tmp_path / 'hub'}")
    assert "could not upload" in line and "HTTP 403" in line
    assert f"the repo {REPO} exists on the Hub" in line and "nothing was committed" in line
    assert "/api/repos/create" in fake.requests and fake.requests[-1] != "/api/repos/create"


def test_a_hub_that_never_answers_times_out(head, tmp_path, hub, capsys):
    fake = hub("hang")
    start = time.monotonic()
    line = refused(capsys, f"head={head}", *COMMON, f"out={tmp_path / 'hub'}")
    assert time.monotonic() - start < 30
    assert "did not answer within hub_timeout=2 s" in line and "nothing was created" in line
    assert fake.requests[-1] == "/api/repos/create"


def test_an_unreachable_hub_is_one_sentence(head, tmp_path, hub, capsys):
    url = closed_port()
    hub.point_at(url)
    line = refused(capsys, f"head={head}", *COMMON, f"out={tmp_path / 'hub'}")
    assert f"on {url}: it cannot be reached" in line and "nothing was created" in line


def test_the_timeout_restores_the_client_factory(head, tmp_path, hub, capsys):
    from huggingface_hub.utils import _http

    before = _http._GLOBAL_CLIENT_FACTORY
    hub("500")
    refused(capsys, f"head={head}", *COMMON, f"out={tmp_path / 'hub'}")
    assert _http._GLOBAL_CLIENT_FACTORY is before


def _cli(tmp_path, env, *argv, timeout=120):
    env = {**os.environ, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": str(tmp_path / "hf-home"),
           **env}
    done = subprocess.run([sys.executable, "-m", "draftsmith.cli", "publish", *argv], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in done.stderr and TOKEN not in done.stderr, done.stderr
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    return lines[0]


def test_offline_is_refused_before_any_work(head, tmp_path):
    line = _cli(tmp_path, {"HF_HUB_OFFLINE": "1"}, f"head={head}", *COMMON, f"out={tmp_path / 'hub'}")
    assert line == ("draftsmith publish: error: HF_HUB_OFFLINE is set, so publish cannot reach the Hub and nothing "
                    "was written or uploaded: unset HF_HUB_OFFLINE to upload, or pass dry_run=true to write the "
                    "folder only.")
    assert not (tmp_path / "hub").exists()


@pytest.mark.slow  # a fresh process waiting out a hanging server
def test_a_hanging_hub_through_hf_endpoint_in_a_fresh_process(head, tmp_path):
    fake = FakeHub("hang")
    try:
        line = _cli(tmp_path, {"HF_ENDPOINT": fake.url}, f"head={head}", *COMMON, f"out={tmp_path / 'hub'}", timeout=90)
    finally:
        fake.close()
    assert f"on {fake.url}: it did not answer within hub_timeout=2 s" in line
    assert fake.requests[-1] == "/api/repos/create"


# ---- what goes public ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A head trained for a target in a local folder, evaluated, everything under a folder named like a user's."""
    from draftsmith.data_gen.target import TargetConfig, load_target
    from draftsmith.eval.run import run as eval_run

    root = tmp_path_factory.mktemp("public") / "alice-private" / "runs"
    root.mkdir(parents=True)
    questions = root / "question.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["What is 2+2?"]}) + "\n")
    identity = {**load_target(TargetConfig(name="tiny")).identity(), "target_id": str(root / "models" / "Tiny-8B")}
    head = Path(save_tiny_head(root / "head", identity))
    eval_run(eval_cfg(str(questions), root / "eval", f"head={head}", "drafting.num_speculative_tokens=2"))
    return root, head


def test_the_published_folder_holds_no_local_path(evaluated, tmp_path, monkeypatch):
    from draftsmith.publish import PublishConfig, run

    root, head = evaluated
    secret = str(root.parent)  # .../alice-private
    report = json.loads((root / "eval" / "report.json").read_text())
    assert str(head) in json.dumps(report) and str(root / "question.jsonl") in json.dumps(report)  # as eval wrote it
    result = run(PublishConfig(head=str(head), report=str(root / "eval"), repo_id=REPO, base_model="someone/tiny-base",
                               license="mit", dry_run=True, out=str(tmp_path / "hub")))
    out = Path(result["out"])
    texts = {}
    for name in result["files"]:
        data = (out / name).read_bytes()
        try:
            texts[name] = data.decode()
        except UnicodeDecodeError:
            continue
    assert {"README.md", "eval/report.json", "eval/report.md", "manifest.json", "config.json"} <= set(texts)
    for name, text in texts.items():
        for local in (secret, "alice-private", str(tmp_path), str(Path.home()), str(root.resolve())):
            assert local not in text, f"{name} holds {local}"
    public = json.loads(texts["eval/report.json"])
    assert public["drafter"]["path"] == REPO and public["prompts"]["path"] == "question.jsonl"
    assert json.loads(texts["manifest.json"])["target"]["target_id"] == "someone/tiny-base"
    assert f'"model": "{REPO}"' in public["recommendation"]["vllm"]["command"]


@pytest.mark.parametrize("name", ["report.md", "report.png", "report.json"])
def test_a_linked_eval_file_is_refused(evaluated, tmp_path, name):
    from draftsmith.core import DraftsmithError
    from draftsmith.publish import PublishConfig, run

    root, head = evaluated
    eval_copy = tmp_path / "eval"
    import shutil

    shutil.copytree(root / "eval", eval_copy)
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-TOKEN-STAND-IN")
    (eval_copy / name).unlink()
    if name == "report.json":
        (tmp_path / "real.json").write_text((root / "eval" / "report.json").read_text())
        (eval_copy / name).symlink_to(tmp_path / "real.json")
    else:
        (eval_copy / name).symlink_to(secret)
    with pytest.raises(DraftsmithError, match="is a symbolic link") as e:
        run(PublishConfig(head=str(head), report=str(eval_copy), repo_id=REPO, base_model="someone/tiny-base",
                          license="mit", dry_run=True, out=str(tmp_path / "hub")))
    assert str(eval_copy / name) in str(e.value)
    assert not (tmp_path / "hub").exists()


def test_a_linked_file_in_the_head_is_refused(evaluated, tmp_path, hub, capsys):
    import shutil

    _, head = evaluated
    copy = tmp_path / "head"
    shutil.copytree(head, copy)
    (tmp_path / "elsewhere.json").write_text((copy / "manifest.json").read_text())
    (copy / "manifest.json").unlink()
    (copy / "manifest.json").symlink_to(tmp_path / "elsewhere.json")
    line = refused(capsys, f"head={copy}", *COMMON, "dry_run=true", f"out={tmp_path / 'hub'}")
    assert f"{copy / 'manifest.json'} is a symbolic link" in line
