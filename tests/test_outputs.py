"""Outputs never destroy what the stage did not make: out folder ownership, inputs, files, umask, full disk."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest
from helpers import cli_error, make_tiny_data, random_head, snapshot

from draftsmith.core import DraftsmithError
from draftsmith.core import artifacts as mf
from draftsmith.cli import main
from draftsmith.heads.eagle3_folders import save_eagle3

TRAIN = ["method=eagle3", "target=tiny", "wandb.mode=disabled", "progress=false", "deepspeed=none",
         "method.draft_vocab_size=64", "method.ttt_steps=2", "micro_batch_size=2"]


@pytest.fixture
def head(tiny_target, tmp_path):
    return save_eagle3(random_head(tiny_target), tmp_path / "run" / "final", manifest_target=tiny_target.identity())


@pytest.fixture(scope="module")
def train_run(tiny_target, tmp_path_factory):
    """A real (tiny) training run: config.yaml, checkpoints/, metrics.jsonl, final/."""
    root = tmp_path_factory.mktemp("trained")
    data = make_tiny_data(root / "data", tiny_target, n=4)
    main(["train", *TRAIN, f"data={data}", f"out={root / 'run'}", "max_steps=2", "save_every=1"])
    return root / "run"


# --------------------------------------------------------------------------- export

def test_export_into_the_training_run_is_refused_and_the_run_kept(train_run, capsys):
    before = snapshot(train_run)
    assert "metrics.jsonl" in before and "config.yaml" in before and any(k.startswith("checkpoints") for k in before)
    err = cli_error(capsys, ["export", f"head={train_run / 'final'}", f"out={train_run}"])
    assert f"out={train_run} contains the head" in err
    # even with overwrite=true: the folder holds the head being exported
    err = cli_error(capsys, ["export", f"head={train_run / 'final'}", f"out={train_run}", "overwrite=true"])
    assert "overwrite=true does not change this" in err
    assert snapshot(train_run) == before


def test_export_into_a_user_folder_is_refused_then_overwrite_writes_beside_the_users_files(head, tmp_path, capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    (precious / "sub").mkdir()
    (precious / "sub" / "data.bin").write_bytes(b"\0\1")
    before = snapshot(precious)
    err = cli_error(capsys, ["export", f"head={head}", f"out={precious}"])
    assert f"out={precious} already holds files draftsmith export did not write" in err and "overwrite=true" in err
    assert snapshot(precious) == before
    main(["export", f"head={head}", f"out={precious}", "overwrite=true"])  # the user asked for it
    assert (precious / "model.safetensors").is_file()
    assert {k: v for k, v in snapshot(precious).items() if k in before} == before  # write there, delete nothing
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left beside it


def test_export_twice_replaces_its_own_output(head, tmp_path, tiny_target):
    out = tmp_path / "exported"
    for fmt in ("eagle3", "eagle3", "speculators"):
        main(["export", f"head={head}", f"out={out}", f"format={fmt}"])
        assert mf.read_manifest(out)["produced_by"]["stage"] == "export"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Eagle3DraftModel"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # a head without a manifest: the export is still recognised as export's own on a rerun
    bare = save_eagle3(random_head(tiny_target), tmp_path / "bare")
    for _ in range(2):
        main(["export", f"head={bare}", f"out={tmp_path / 'bare-out'}"])
    assert mf.owns(tmp_path / "bare-out", "export")


def test_export_into_another_stage_output_is_refused(head, tmp_path, tiny_target, capsys):
    data = make_tiny_data(tmp_path / "data", tiny_target, n=2)
    before = snapshot(data)
    err = cli_error(capsys, ["export", f"head={head}", f"out={data}"])
    assert "already holds data-gen's output" in err
    err = cli_error(capsys, ["export", f"head={head}", f"out={head.parent.parent}", "overwrite=true"])
    assert "contains the head" in err
    assert snapshot(data) == before and (head / "model.safetensors").is_file()


def test_exported_head_has_the_users_umask(head, tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "shared"
        main(["export", f"head={head}", f"out={out}"])
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    for p in out.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p.name


def test_full_disk_during_the_swap_is_one_sentence_and_keeps_the_old_export(head, tmp_path, monkeypatch):
    out = tmp_path / "exported"
    main(["export", f"head={head}", f"out={out}"])
    before = snapshot(out)
    real_replace = os.replace

    def full(src, dst):
        if str(src).endswith(".tmp") and str(dst) == str(out):  # the new folder moving into place
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src, dst)

    monkeypatch.setattr(mf.os, "replace", full)
    with pytest.raises(DraftsmithError, match=f"could not write {out}: No space left on device"):
        from draftsmith.export import ExportConfig, run

        run(ExportConfig(head=str(head), out=str(out)))
    assert snapshot(out) == before  # the earlier export put back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "run"]  # no .tmp / .old left


def test_full_disk_in_a_file_write_names_the_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    path.write_text("old")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(mf.os, "fsync", full)
    with pytest.raises(DraftsmithError) as e:
        mf.atomic_write_json(path, {"a": 1})
    assert str(e.value) == f"could not write {path}: No space left on device; nothing there was replaced."
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


# --------------------------------------------------------------------------- train

def test_train_into_a_data_gen_folder_is_refused(tiny_target, tmp_path, capsys):
    data = make_tiny_data(tmp_path / "data", tiny_target, n=4)
    other = make_tiny_data(tmp_path / "other", tiny_target, n=4)
    (other / "config.yaml").write_text("data-gen's config\n")
    before = snapshot(other)
    err = cli_error(capsys, ["train", *TRAIN, f"data={data}", f"out={other}", "max_steps=1"])
    assert f"out={other} already holds data-gen's output" in err
    err = cli_error(capsys, ["train", *TRAIN, f"data={data}", f"out={data}", "max_steps=1", "overwrite=true"])
    assert "is the data folder" in err
    assert snapshot(other) == before


def test_train_fresh_rerun_in_its_own_output_starts_a_new_log(tiny_target, tmp_path):
    data = make_tiny_data(tmp_path / "data", tiny_target, n=4)
    out = tmp_path / "run"
    mf.claim_output(out, "train")  # a run killed before its first checkpoint
    (out / "metrics.jsonl").write_text(json.dumps({"step": 7, "loss": 1.0}) + "\n")
    main(["train", *TRAIN, f"data={data}", f"out={out}", "max_steps=1", "save_every=1000"])
    steps = [json.loads(ln).get("step") for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert 7 not in steps and steps


# --------------------------------------------------------------------------- out= that is a file or `.`

def stage_args(stage, tmp_path, head, data):
    return {
        "data-gen": ["data-gen", "target=tiny", "prompts=question", f"prompts.path={tmp_path / 'q.jsonl'}"],
        "train": ["train", *TRAIN, f"data={data}"],
        "eval": ["eval", "target=tiny", "head=ngram", "prompts=question", f"prompts.path={tmp_path / 'q.jsonl'}"],
        "export": ["export", f"head={head}"],
        "demo": ["demo", "flavour=tiny"],
    }[stage]


@pytest.mark.parametrize("stage", ["data-gen", "train", "eval", "export", "demo"])
def test_out_that_is_a_file_or_the_current_folder_is_refused_before_any_work(stage, head, tmp_path, tiny_target,
                                                                              capsys, monkeypatch):
    import draftsmith.data_gen.target as target_module

    data = make_tiny_data(tmp_path / "data", tiny_target, n=2)
    (tmp_path / "q.jsonl").write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Hi?"]}) + "\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.txt").write_text("mine")
    monkeypatch.chdir(work)

    def no_work(*a, **k):
        raise AssertionError("the stage started working")

    monkeypatch.setattr(target_module, "load_target", no_work)
    for mod in ("draftsmith.data_gen.run", "draftsmith.train.run", "draftsmith.eval.run"):
        monkeypatch.setattr(f"{mod}.load_target", no_work)
    args = stage_args(stage, tmp_path, head, data)
    err = cli_error(capsys, [*args, f"out={work / 'mine.txt'}"])
    assert f"out={work / 'mine.txt'} is an existing file, not a folder" in err
    for out in (".", "..", str(work)):
        err = cli_error(capsys, [*args, f"out={out}", "overwrite=true"])
        assert f"out={out} " in err and "current folder" in err
    assert sorted(p.name for p in work.iterdir()) == ["mine.txt"]


def test_eval_into_a_file_is_refused_before_decoding(tmp_path, capsys, monkeypatch):
    import draftsmith.eval.run as eval_run

    (tmp_path / "q.jsonl").write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Hi?"]}) + "\n")
    report = tmp_path / "report.md"
    report.write_text("my notes")
    monkeypatch.setattr(eval_run, "speculative_generate", lambda *a, **k: pytest.fail("decoded"))
    err = cli_error(capsys, ["eval", "target=tiny", "head=ngram", "prompts=question",
                             f"prompts.path={tmp_path / 'q.jsonl'}", f"out={report}"])
    assert "is an existing file" in err and report.read_text() == "my notes"
    err = cli_error(capsys, ["eval", "target=tiny", "head=ngram", "prompts=question",
                             f"prompts.path={tmp_path / 'q.jsonl'}", f"out={tmp_path}", "overwrite=true"])
    assert "contains the prompts.path" in err


# --------------------------------------------------------------------------- demo

def test_demo_refuses_user_files_in_its_stage_folders(tmp_path, capsys, monkeypatch):
    import draftsmith.demo as demo

    monkeypatch.setattr(demo, "_run_stage", lambda *a: pytest.fail("a stage ran"))
    proj = tmp_path / "proj"
    mf.claim_output(proj, "demo")  # an earlier demo run ...
    (proj / "head").mkdir()
    (proj / "head" / "notes.txt").write_text("mine")  # ... with the user's own file where the head goes
    err = cli_error(capsys, ["demo", "flavour=tiny", f"out={proj}"])
    assert f"out={proj / 'head'} already holds files draftsmith train did not write" in err
    assert (proj / "head" / "notes.txt").read_text() == "mine"

    user = tmp_path / "user"
    (user / "eval").mkdir(parents=True)
    (user / "eval" / "report.md").write_text("mine")
    err = cli_error(capsys, ["demo", "flavour=tiny", f"out={user}"])
    assert f"out={user} already holds files draftsmith demo did not write" in err
    assert snapshot(user) == {"eval/report.md": b"mine"}


def test_demo_redo_removes_only_what_the_stage_wrote(tmp_path):
    from draftsmith.demo import clear_stage

    head = tmp_path / "head"
    mf.claim_output(head, "train")
    (head / "checkpoints" / "step_1").mkdir(parents=True)
    (head / "metrics.jsonl").write_text("{}\n")
    (head / "notes.txt").write_text("mine")
    clear_stage(head, "train")
    assert sorted(p.name for p in head.iterdir()) == [mf.OWNER, "notes.txt"]
    user = tmp_path / "eval"
    user.mkdir()
    (user / "report.md").write_text("mine")
    with pytest.raises(DraftsmithError, match="did not write"):
        clear_stage(user, "eval")
    assert (user / "report.md").read_text() == "mine"


# --------------------------------------------------------------------------- manifests and ownership

@pytest.mark.parametrize("content, kind", [("[]", "array"), ("3", "number"), ('"x"', "string"), ("null", "null")])
def test_manifest_that_is_not_an_object_is_one_sentence(tmp_path, content, kind):
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(DraftsmithError) as e:
        mf.read_manifest(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'manifest.json'} is not a draftsmith manifest: it holds a JSON {kind}, "
                            f"not an object.")


def test_prepare_output_rules(tmp_path, tiny_target):
    assert mf.prepare_output(tmp_path / "new", "eval") == tmp_path / "new"  # writes nothing
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    mf.prepare_output(tmp_path / "empty", "eval")
    own = mf.claim_output(tmp_path / "own", "eval")
    (own / "report.json").write_text("{}")
    mf.prepare_output(own, "eval")
    with pytest.raises(DraftsmithError, match="already holds an eval report"):
        mf.prepare_output(own, "train")
    with pytest.raises(DraftsmithError, match="overwrite=true never writes over another draftsmith stage's output"):
        mf.prepare_output(own, "train", overwrite=True)  # its owner file and config would lie
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    mf.prepare_output(tmp_path / "user", "train", overwrite=True)  # a user's folder: the user asked for it
    (tmp_path / "d").mkdir()
    with pytest.raises(DraftsmithError, match="is inside the data folder"):
        mf.prepare_output(tmp_path / "d" / "sub", "train", [("data", tmp_path / "d")], overwrite=True)
    (tmp_path / "f").write_text("x")
    with pytest.raises(DraftsmithError, match="is a file, not a folder"):
        mf.prepare_output(tmp_path / "f" / "sub", "eval")
    # a folder that merely looks like a stage's output is the user's: only an owner file or a manifest says otherwise
    lookalike = tmp_path / "lookalike"
    (lookalike / "checkpoints").mkdir(parents=True)
    (lookalike / "metrics.jsonl").write_text("")
    assert mf.owner_of(lookalike) is None
    with pytest.raises(DraftsmithError, match="already holds files draftsmith train did not write"):
        mf.prepare_output(lookalike, "train")
    # a head folder (train's final/) is not a training run
    head = save_eagle3(random_head(tiny_target), tmp_path / "h", manifest_target=tiny_target.identity())
    with pytest.raises(DraftsmithError, match="holds a trained head"):
        mf.prepare_output(head, "train")
