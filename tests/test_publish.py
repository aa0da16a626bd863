"""`draftsmith publish`: the card carries the eval report's numbers and valid Hub metadata, the upload goes through
huggingface_hub (its HTTP client replaced by a mock transport: no hub is reachable) in one commit without the
token anywhere, and the refusals (no report, another head's report, a bad repo id) come before any work."""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path

import pytest
from helpers import eval_cfg, save_tiny_head

from draftsmith.core import DraftsmithError
from draftsmith.cli import main
from draftsmith.publish import PublishConfig, run

TOKEN = "hf_draftsmithTestTokenNeverShown0123"
REPO = "someone/tiny-eagle3"


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """(head folder, eval out folder, report): a tiny EAGLE-3 head and a real eval of it."""
    from draftsmith.eval.run import run as eval_run

    root = tmp_path_factory.mktemp("evaluated")
    questions = root / "question.jsonl"
    rows = [{"question_id": 1, "category": "math", "turns": ["What is 2+2?"]},
            {"question_id": 2, "category": "writing", "turns": ["Say hi."]}]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    head = Path(save_tiny_head(root / "head"))
    report = eval_run(eval_cfg(str(questions), root / "eval", f"head={head}", "drafting.num_speculative_tokens=4"))
    return head, root / "eval", report


def publish_cfg(head, tmp_path, **kw) -> PublishConfig:
    kw = {"repo_id": REPO, "base_model": "someone/tiny-base", "license": "apache-2.0", "out": str(tmp_path / "hub"),
          **kw}
    return PublishConfig(head=str(head), **kw)


def test_dry_run_card_carries_the_report_and_valid_hub_metadata(evaluated, tmp_path):
    from huggingface_hub import ModelCard, metadata_load

    head, eval_out, report = evaluated
    result = run(publish_cfg(head, tmp_path, report=str(eval_out), dry_run=True))
    out = tmp_path / "hub"
    assert result["uploaded"] is False and Path(result["out"]) == out
    assert {"README.md", "config.json", "model.safetensors", "speculators/config.json",
            "speculators/model.safetensors", "eval/report.json", "eval/report.png"} <= set(result["files"])
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert json.loads((out / "speculators/config.json").read_text())["speculators_config"]["verifier"][
        "name_or_path"] == "someone/tiny-base"

    card = ModelCard.load(out / "README.md")
    data = card.data
    assert data.base_model == "someone/tiny-base" and data.license == "apache-2.0"
    assert data.library_name == "vllm" and data.pipeline_tag == "text-generation"
    assert {"eagle3", "speculative-decoding", "sglang", "speculators"} <= set(data.tags)
    values = {r.metric_type: r.metric_value for r in data.eval_results}
    assert values["acceptance_length"] == pytest.approx(report["tau"], abs=1e-4)
    assert values["speedup"] == pytest.approx(report["speedup"], abs=1e-4)
    assert values["acceptance_rate"] == pytest.approx(report["per_position_acceptance"][0], abs=1e-4)
    assert data.model_name == "tiny-eagle3"
    meta = metadata_load(out / "README.md")
    assert meta["model-index"][0]["results"][0]["task"]["type"] == "text-generation"

    text = card.text
    assert f"| acceptance length τ | {report['tau']:.2f} |" in text
    assert f"| speedup vs target-only | {report['speedup']:.2f}x |" in text
    assert "bonus token included" in text and "eval/report.png" in text  # conventions and the plot
    spec = '{"method": "eagle3", "model": "someone/tiny-eagle3", "num_speculative_tokens": 4}'
    assert f"vllm serve someone/tiny-base \\\n    --speculative-config '{spec}'" in text
    sglang = ("python -m sglang.launch_server --model-path someone/tiny-base \\\n"
              "    --speculative-algorithm EAGLE3 \\\n    --speculative-draft-model-path someone/tiny-eagle3 \\\n"
              "    --speculative-num-steps 4 \\\n    --speculative-eagle-topk 1 \\\n"
              "    --speculative-num-draft-tokens 5\n")
    assert sglang in text  # the same flags eval's report recommends (eval/cost.py serving_settings)


def test_upload_is_one_commit_through_huggingface_hub_without_the_token(evaluated, tmp_path, monkeypatch, capsys):
    import httpx2
    from huggingface_hub.utils import _http

    head, eval_out, _ = evaluated
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    requests = []

    def hub(request: httpx2.Request) -> httpx2.Response:
        requests.append(request)
        path = request.url.path
        if path == "/api/repos/create":
            return httpx2.Response(200, json={"url": f"https://huggingface.co/{REPO}", "name": REPO})
        if path == "/api/validate-yaml":
            return httpx2.Response(200, json={})
        if path == f"/api/models/{REPO}/preupload/main":
            files = json.loads(request.content)["files"]
            return httpx2.Response(200, json={"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                        for f in files]})
        if path == f"/api/models/{REPO}/commit/main":
            return httpx2.Response(200, json={"commitUrl": f"https://huggingface.co/{REPO}/commit/c0ffee",
                                              "commitOid": "c0ffee"})
        return httpx2.Response(404, json={"error": f"not mocked: {path}"})

    _http.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(hub)))
    try:
        result = run(publish_cfg(head, tmp_path, report=str(eval_out), private=True))
    finally:
        _http.set_client_factory(_http.default_client_factory)
    assert result["uploaded"] and result["commit"] == "c0ffee"

    creates = [r for r in requests if r.url.path == "/api/repos/create"]
    assert len(creates) == 1
    created = json.loads(creates[0].content)
    assert created.get("visibility") == "private" or created.get("private") is True
    commits = [r for r in requests if r.url.path.endswith("/commit/main")]
    assert len(commits) == 1  # one commit
    body = commits[0].content
    if commits[0].headers.get("content-encoding") == "gzip":
        body = gzip.decompress(body)
    lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
    sent = {line["value"]["path"]: base64.b64decode(line["value"]["content"])
            for line in lines if line["key"] == "file"}
    out = tmp_path / "hub"
    assert sorted(sent) == result["files"]
    assert {"README.md", "config.json", "model.safetensors", "manifest.json", "speculators/config.json",
            "speculators/model.safetensors", "speculators/manifest.json", "eval/report.json", "eval/report.md",
            "eval/report.png"} == set(sent)
    assert ".draftsmith_owner.json" not in sent  # draftsmith's own bookkeeping stays local
    for name, content in sent.items():
        assert content == (out / name).read_bytes()
    assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in requests if r.url.path != "/api/agent-harnesses")

    from draftsmith.publish import summary

    print(summary(result))  # what the CLI prints
    printed = capsys.readouterr()
    assert TOKEN not in printed.out + printed.err
    assert "one commit" in printed.out
    for path in out.rglob("*"):
        assert not path.is_file() or TOKEN.encode() not in path.read_bytes()
    assert all(TOKEN.encode() not in r.content for r in requests)  # only ever in the Authorization header


def test_refused_without_a_report_unless_allowed(evaluated, tmp_path):
    from huggingface_hub import ModelCard

    head, _, _ = evaluated
    with pytest.raises(DraftsmithError, match="allow_no_eval=true"):
        run(publish_cfg(head, tmp_path, dry_run=True))
    assert not (tmp_path / "hub").exists()
    run(publish_cfg(head, tmp_path, dry_run=True, allow_no_eval=True, formats=["eagle3"]))
    card = ModelCard.load(tmp_path / "hub" / "README.md")
    assert "Not measured" in card.text and not card.data.eval_results
    assert "num_speculative_tokens\": 3" in card.text  # no report: the default K


def test_report_of_another_head_is_refused(evaluated, tmp_path):
    import torch

    from draftsmith.heads.eagle3_folders import load_eagle3, save_eagle3

    head, eval_out, _ = evaluated
    other = load_eagle3(head)
    with torch.no_grad():
        other.fc.weight.mul_(2)
    save_eagle3(other, tmp_path / "other")
    with pytest.raises(DraftsmithError, match="is not an eval of head"):
        run(publish_cfg(tmp_path / "other", tmp_path, report=str(eval_out), dry_run=True, allow_no_eval=True))
    assert not (tmp_path / "hub").exists()


@pytest.mark.parametrize("repo_id", ["no-namespace", "a/b/c", "bad--name/x", "me/has space", "me/x.git", "me/"])
def test_invalid_repo_id_is_refused_before_any_export(evaluated, tmp_path, monkeypatch, repo_id, capsys):
    import draftsmith.heads.eagle3_folders as checkpoint

    head, eval_out, _ = evaluated
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: pytest.fail("exported before checking repo_id"))
    with pytest.raises(SystemExit) as e:
        main(["publish", f"head={head}", f"repo_id={repo_id}", f"report={eval_out}", f"out={tmp_path / 'hub'}",
              "dry_run=true", "license=mit", "base_model=a/b"])
    assert e.value.code == 2
    assert "is not a valid Hub repo id" in capsys.readouterr().err
    assert not (tmp_path / "hub").exists()


def test_target_without_a_hub_id_or_license_is_refused(evaluated, tmp_path):
    head, eval_out, _ = evaluated
    with pytest.raises(DraftsmithError, match="base_model="):  # the tiny target has no Hub id
        run(PublishConfig(head=str(head), repo_id=REPO, report=str(eval_out), out=str(tmp_path / "hub"), dry_run=True))
    with pytest.raises(DraftsmithError, match="license="):
        run(PublishConfig(head=str(head), repo_id=REPO, report=str(eval_out), base_model="someone/tiny-base",
                          out=str(tmp_path / "hub"), dry_run=True))
    assert not (tmp_path / "hub").exists()


def test_upload_needs_a_token_before_any_work(evaluated, tmp_path, monkeypatch):
    import huggingface_hub

    head, eval_out, _ = evaluated
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(DraftsmithError, match="HF_TOKEN"):
        run(publish_cfg(head, tmp_path, report=str(eval_out)))
    assert not (tmp_path / "hub").exists()


def test_card_summarises_the_training_run_and_its_data(evaluated, tmp_path):
    """A train out/ folder (final/ + config.yaml naming data=) and the data-gen manifest it points at."""
    import shutil

    from huggingface_hub import ModelCard

    from draftsmith.core.artifacts import atomic_write_bytes, write_manifest

    head, _, _ = evaluated
    data = tmp_path / "data"
    write_manifest(data, "data_gen", {"target_id": "tiny"}, {"samples": 170, "tokens": 51234, "loss_tokens": 40001})
    atomic_write_bytes(data / "config.yaml", b"prompts:\n  source: self\n")
    run_dir = tmp_path / "train"
    shutil.copytree(head, run_dir / "final")
    atomic_write_bytes(run_dir / "config.yaml", f"method: eagle3\ndata: {data}\nlr: 0.0001\nttt_steps: 7\n"
                                                f"precision: bf16\nmode: online\n".encode())
    run(publish_cfg(run_dir, tmp_path, dry_run=True, allow_no_eval=True, formats=["speculators"]))
    text = ModelCard.load(tmp_path / "hub" / "README.md").text
    assert "170 samples, 51234 tokens" in text and "40001 assistant tokens" in text and "(self)" in text
    assert "- precision: bf16" in text and "SGLang loads the EAGLE-3 format" in text
    assert json.loads((tmp_path / "hub" / "config.json").read_text())["architectures"] == ["Eagle3DraftModel"]


def test_publish_does_not_write_over_user_files(evaluated, tmp_path):
    head, eval_out, _ = evaluated
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "notes.txt").write_text("mine")
    with pytest.raises(DraftsmithError, match="choose another out"):
        run(publish_cfg(head, tmp_path, report=str(eval_out), dry_run=True))
    assert (tmp_path / "hub" / "notes.txt").read_text() == "mine"
    run(publish_cfg(head, tmp_path / "again", report=str(eval_out), dry_run=True))
    run(publish_cfg(head, tmp_path / "again", report=str(eval_out), dry_run=True))  # its own earlier output: fine


def test_user_files_kept_in_the_publish_folder_are_never_uploaded(evaluated, tmp_path):
    from draftsmith.publish_folder import upload_files

    head, eval_out, _ = evaluated
    first = run(publish_cfg(head, tmp_path, report=str(eval_out), dry_run=True))
    out = tmp_path / "hub"
    (out / "notes.txt").write_text("private")
    (out / "eval" / "USER_NOTE.txt").write_text("private")
    (out / "mine").mkdir()
    (out / "mine" / "secret.txt").write_text("private")
    again = run(publish_cfg(head, tmp_path, report=str(eval_out), dry_run=True))  # a rerun keeps them locally
    assert (out / "notes.txt").read_text() == (out / "eval" / "USER_NOTE.txt").read_text() == "private"
    assert again["files"] == first["files"] == upload_files(out)
    assert not {"notes.txt", "eval/USER_NOTE.txt", "mine/secret.txt"} & set(upload_files(out))
    assert "README.md" in upload_files(out) and "eval/report.json" in upload_files(out)
