"""Every stage keeps the user's files (issue 19, items 1 and 5a).

For data-gen, train, eval, export, publish (dry run: no Hub) and the tiny demo, user files (checked
by hash) are put (a) into a user folder written with overwrite=true, (b) into the stage's own
earlier output, at the top and inside the subfolders it writes (conversations/, hidden_states/,
final/, eval/, head/final/ ...), before a rerun, and (c) behind `out=<a link to a user folder>`,
which is refused with one sentence naming the folder it points to. overwrite=true into another
stage's output is refused (its provenance would lie), and a kill -9 leftover of a stage's own
temporary names is cleaned by the rerun.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from draftsmith.core import DraftsmithError
from draftsmith.core import artifacts as mf
from draftsmith.cli import main
from helpers import cli_error, snapshot

TRAIN = ["train", "method=eagle3", "target=tiny", "wandb.mode=disabled", "progress=false", "deepspeed=none",
         "method.draft_vocab_size=64", "method.ttt_steps=2", "micro_batch_size=2", "max_steps=2"]
REPO = "someone/tiny-eagle3"
QUESTIONS = [{"question_id": 100 + i, "category": "math" if i % 2 else "writing", "turns": [f"Question {i}?"]}
             for i in range(6)]


def plant(folder: Path, rels) -> dict[str, str]:
    """Write a user file (distinct bytes) at each relative path under `folder`; {path: sha256}."""
    hashes = {}
    for rel in rels:
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = f"the user's own {rel}\n".encode() + os.urandom(16)
        path.write_bytes(data)
        hashes[rel] = hashlib.sha256(data).hexdigest()
    return hashes


def survived(folder: Path, hashes: dict[str, str]) -> None:
    lost = [rel for rel, h in hashes.items()
            if not (folder / rel).is_file() or hashlib.sha256((folder / rel).read_bytes()).hexdigest() != h]
    assert not lost, f"user files lost or changed in {folder}: {lost}"


def refused_through_a_link(capsys, tmp_path: Path, argv, overwrite_ok: bool = True) -> None:
    """(c): out= a link to a user folder is refused with one sentence naming that folder, with or without
    overwrite=true, and nothing in the folder changes."""
    user = tmp_path / "linked-user"
    hashes = plant(user, ["notes.txt", "sub/deep.bin", "final/mine.txt", "eval/mine.txt"])
    before = snapshot(user)
    link = tmp_path / "link"
    link.symlink_to(user, target_is_directory=True)
    for extra in ([], ["overwrite=true"]):
        err = cli_error(capsys, [*argv, f"out={link}", *extra])
        assert f"out={link}" in err and str(user) in err and "link" in err, err
    survived(user, hashes)
    assert snapshot(user) == before and link.is_symlink()


# --------------------------------------------------------------------------- shared outputs (one of each)

@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("user-files")


@pytest.fixture(scope="module")
def questions(root):
    path = root / "q.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def data_gen_args(questions, *extra):
    return ["data-gen", "target=tiny", "prompts=question", f"prompts.path={questions}", "max_new_tokens=6", *extra]


def eval_args(questions, *extra):
    return ["eval", "target=tiny", "target.dtype=float32", "prompts=question", f"prompts.path={questions}",
            "prompts.n=null", "max_new_tokens=8", "repeats=1", "progress=false", "plot=false", *extra]


@pytest.fixture(scope="module")
def data(root, questions):
    """A real data-gen output with hidden states (read by train; never written by a test)."""
    out = root / "data"
    main(data_gen_args(questions, "hidden_states=true", "samples_per_shard=2", f"out={out}"))
    return out


@pytest.fixture(scope="module")
def run_dir(root, data):
    """A real training run: config.yaml, checkpoints/, metrics.jsonl, final/ (never written by a test)."""
    out = root / "run"
    main([*TRAIN, f"data={data}", f"out={out}", "save_every=1"])
    return out


@pytest.fixture(scope="module")
def evaluated(root, questions, run_dir):
    """An eval report of run_dir/final, for publish."""
    out = root / "eval"
    main(eval_args(questions, f"head={run_dir / 'final'}", f"out={out}"))
    return out


# --------------------------------------------------------------------------- data-gen

def test_data_gen_keeps_user_files(data, questions, tmp_path, capsys):
    # (a) a user folder, overwrite=true (hidden_states=false: data-gen removes what it wrote there, only that)
    user = tmp_path / "user"
    hashes = plant(user, ["notes.txt", "sub/deep.bin", "conversations/mine.txt", "hidden_states/mine.txt",
                          "tokenized/mine.txt", "regenerated/mine.txt"])
    err = cli_error(capsys, data_gen_args(questions, f"out={user}"))
    assert "overwrite=true" in err
    main(data_gen_args(questions, f"out={user}", "overwrite=true"))
    survived(user, hashes)
    assert mf.owns(user, "data_gen") and (user / "conversations" / "state.json").is_file()

    # (b) its own earlier output: a rerun that redoes the sets and recaptures, then one that drops hidden states
    own = tmp_path / "own"
    shutil.copytree(data, own, symlinks=True)
    hashes = plant(own, ["USER_NOTE.txt", "conversations/USER_NOTE.txt", "tokenized/USER_NOTE.txt",
                         "hidden_states/USER_NOTE.txt", "regenerated/USER_NOTE.txt"])
    main(data_gen_args(questions, "hidden_states=true", "samples_per_shard=3", "max_length=40", f"out={own}"))
    survived(own, hashes)
    main(data_gen_args(questions, "max_length=32", f"out={own}"))  # no hidden states now: data-gen removes its own
    survived(own, hashes)
    assert not list((own / "hidden_states").glob("shard_*")) and not (own / "hidden_states" / "index.json").exists()
    # overwrite=true on its own output keeps them too
    main(data_gen_args(questions, "max_length=36", f"out={own}", "overwrite=true"))
    survived(own, hashes)

    # (c) out= a link to a user folder
    refused_through_a_link(capsys, tmp_path, data_gen_args(questions))


def test_data_gen_rerun_cleans_a_killed_runs_temporaries(data, questions, tmp_path):
    own = tmp_path / "own"
    shutil.copytree(data, own, symlinks=True)
    # what kill -9 in the middle of writing conversations/ (and a chunk file) leaves behind
    (own / ".conversations.k9abc_12.tmp").mkdir()
    (own / ".conversations.k9abc_12.tmp" / "data-00000-of-00001.arrow").write_bytes(b"half")
    (own / "regenerated" / ".chunk_00000.json.k9abc_34.tmp").write_bytes(b"half")
    hashes = plant(own, ["conversations/USER_NOTE.txt", ".my.hidden.notes.tmp"])  # not a temporary of ours
    main(data_gen_args(questions, "hidden_states=true", "samples_per_shard=2", "max_length=40", f"out={own}"))
    leftovers = [p.name for p in [*own.iterdir(), *(own / "regenerated").iterdir()]
                 if p.name.endswith((".tmp", ".old")) and p.name != ".my.hidden.notes.tmp"]
    assert leftovers == []
    survived(own, hashes)


# --------------------------------------------------------------------------- train

def test_train_keeps_user_files(data, run_dir, tmp_path, capsys):
    # a user folder that merely looks like a training run is not train's: refused without overwrite=true
    user = tmp_path / "user"
    (user / "checkpoints").mkdir(parents=True)
    (user / "config.yaml").write_text("the user's config\n")
    hashes = plant(user, ["final/mine.txt", "notes.txt", "sub/deep.bin", "checkpoints/mine.txt"])
    before = snapshot(user)
    err = cli_error(capsys, [*TRAIN, f"data={data}", f"out={user}"])
    assert f"out={user} already holds files draftsmith train did not write" in err
    assert snapshot(user) == before
    # overwrite=true never replaces the user's config.yaml (issue 49): refused, naming it, until it is renamed
    err = cli_error(capsys, [*TRAIN, f"data={data}", f"out={user}", "overwrite=true"])
    assert f"{user / 'config.yaml'} is a file of yours" in err and snapshot(user) == before
    (user / "config.yaml").rename(user / "my-config.yaml")
    hashes.update({"my-config.yaml": hashlib.sha256(b"the user's config\n").hexdigest()})
    # (a) overwrite=true: train writes there, the user's files stay
    main([*TRAIN, f"data={data}", f"out={user}", "overwrite=true"])
    survived(user, hashes)
    assert (user / "final" / "model.safetensors").is_file()

    # (b) its own earlier output: a resumed rerun rewrites final/
    own = tmp_path / "own"
    shutil.copytree(run_dir, own, symlinks=True)
    hashes = plant(own, ["USER_NOTE.txt", "final/USER_NOTE.txt", "checkpoints/USER_NOTE.txt"])
    main([*TRAIN, f"data={data}", f"out={own}", "save_every=1", "resume=true"])
    survived(own, hashes)
    # a fresh run there (its checkpoints gone) with held-out evals: final/ and best/ are replaced, the notes stay
    fresh = tmp_path / "fresh"
    shutil.copytree(run_dir, fresh, symlinks=True)
    shutil.rmtree(fresh / "checkpoints")
    hashes = plant(fresh, ["USER_NOTE.txt", "final/USER_NOTE.txt"])
    main([*TRAIN, f"data={data}", f"out={fresh}", "val_samples=2", "eval_every=1", "save_every=1"])
    hashes.update(plant(fresh, ["best/USER_NOTE.txt"]))
    (fresh / "checkpoints").rename(tmp_path / "gone")
    main([*TRAIN, f"data={data}", f"out={fresh}", "val_samples=2", "eval_every=1", "save_every=1"])
    survived(fresh, hashes)
    assert (fresh / "best" / "model.safetensors").is_file()

    # (c) out= a link to a user folder
    refused_through_a_link(capsys, tmp_path, [*TRAIN, f"data={data}"])


def test_pruned_checkpoints_keep_user_files(tmp_path):
    from draftsmith.train import checkpoint as ckpt

    out = tmp_path / "run"
    for step in (1, 2, 3):
        tmp = ckpt.tmp_path(out, step)
        tmp.mkdir(parents=True)
        (tmp / ckpt.STATE).write_text(json.dumps({"step": step}))
        (tmp / "head.safetensors").write_bytes(b"w")
        if step == 1:
            ckpt.publish(out, step, keep_last=5)
            hashes = plant(ckpt.final_path(out, 1), ["USER_NOTE.txt"])
        else:
            ckpt.publish(out, step, keep_last=1)
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000003"]
    survived(ckpt.final_path(out, 1), hashes)
    assert not (ckpt.final_path(out, 2)).exists()


# --------------------------------------------------------------------------- eval

def test_eval_keeps_user_files(questions, tmp_path, capsys):
    user = tmp_path / "user"
    hashes = plant(user, ["notes.txt", "sub/deep.bin"])
    main(eval_args(questions, "head=ngram", f"out={user}", "overwrite=true"))  # (a)
    survived(user, hashes)
    hashes.update(plant(user, ["USER_NOTE.txt", "sub/USER_NOTE.txt"]))
    main(eval_args(questions, "head=ngram", f"out={user}", "max_new_tokens=6"))  # (b) its own output now
    survived(user, hashes)
    assert mf.read_manifest(user)["produced_by"]["stage"] == "eval"
    refused_through_a_link(capsys, tmp_path, eval_args(questions, "head=ngram"))  # (c)


# --------------------------------------------------------------------------- export

def test_export_keeps_user_files(run_dir, tmp_path, capsys):
    head = run_dir / "final"
    user = tmp_path / "user"
    hashes = plant(user, [f"f{i:02d}.txt" for i in range(12)] + ["sub/deep.bin", "sub/deeper/x.bin"])
    main(["export", f"head={head}", f"out={user}", "overwrite=true"])  # (a)
    survived(user, hashes)
    assert mf.read_manifest(user)["produced_by"]["stage"] == "export"
    own = tmp_path / "own"
    main(["export", f"head={head}", f"out={own}"])
    hashes = plant(own, ["USER_NOTE.txt", "sub/USER_NOTE.txt"])
    for fmt in ("eagle3", "speculators", "eagle3"):  # (b) reruns into its own output, in either format
        main(["export", f"head={head}", f"out={own}", f"format={fmt}"])
        survived(own, hashes)
    assert json.loads((own / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    refused_through_a_link(capsys, tmp_path, ["export", f"head={head}"])  # (c)


# --------------------------------------------------------------------------- publish (dry run: no Hub)

def publish_args(run_dir, evaluated, *extra):
    return ["publish", f"head={run_dir / 'final'}", f"repo_id={REPO}", f"report={evaluated}", "dry_run=true",
            "license=mit", "base_model=a/b", *extra]


def test_publish_keeps_user_files(run_dir, evaluated, tmp_path, capsys):
    user = tmp_path / "user"
    hashes = plant(user, ["notes.txt", "sub/deep.bin", "eval/mine.txt"])
    err = cli_error(capsys, publish_args(run_dir, evaluated, f"out={user}"))
    assert "choose another out" in err
    main(publish_args(run_dir, evaluated, f"out={user}", "overwrite=true"))  # (a)
    survived(user, hashes)
    assert (user / "eval" / "report.json").is_file() and (user / "README.md").is_file()
    own = tmp_path / "own"
    main(publish_args(run_dir, evaluated, f"out={own}"))
    hashes = plant(own, ["USER_NOTE.txt", "eval/USER_NOTE.txt", "speculators/USER_NOTE.txt"])
    main(publish_args(run_dir, evaluated, f"out={own}"))  # (b)
    survived(own, hashes)
    main(publish_args(run_dir, evaluated, f"out={own}", "formats=[eagle3]"))  # a rerun without speculators/
    survived(own, hashes)
    assert not (own / "speculators" / "config.json").exists()
    refused_through_a_link(capsys, tmp_path, publish_args(run_dir, evaluated))  # (c)


# --------------------------------------------------------------------------- demo (flavour=tiny)

@pytest.mark.timeout(300)
def test_demo_keeps_user_files(tmp_path, capsys):
    demo = ["demo", "flavour=tiny", "progress=false"]
    user = tmp_path / "user"
    hashes = plant(user, ["notes.txt", "sub/deep.bin", "data/mine.txt", "head/mine.txt", "head/final/mine.txt",
                          "eval/mine.txt"])
    main([*demo, f"out={user}", "overwrite=true"])  # (a)
    survived(user, hashes)
    assert (user / "head" / "final" / "model.safetensors").is_file()
    hashes.update(plant(user, ["USER_NOTE.txt", "head/final/USER_NOTE.txt", "head/USER_NOTE.txt",
                               "eval/USER_NOTE.txt", "data/conversations/USER_NOTE.txt"]))
    main([*demo, f"out={user}", "train_steps=2"])  # (b) a training knob changed: train and eval are redone
    survived(user, hashes)
    refused_through_a_link(capsys, tmp_path, demo)  # (c)


# --------------------------------------------------------------------------- overwrite=true into another stage

def test_overwrite_never_writes_over_another_stages_output(data, run_dir, evaluated, questions, tmp_path, capsys):
    head = run_dir / "final"
    cases = [
        ([*TRAIN, f"data={data}"], evaluated, "an eval report"),
        (data_gen_args(questions), run_dir, "a training run"),
        (eval_args(questions, "head=ngram"), data, "data-gen's output"),
        (["export", f"head={head}"], data, "data-gen's output"),
        (publish_args(run_dir, evaluated), data, "data-gen's output"),
        (["demo", "flavour=tiny", "progress=false"], run_dir, "a training run"),
    ]
    for argv, other, words in cases:
        before = snapshot(other)
        err = cli_error(capsys, [*argv, f"out={other}", "overwrite=true"])
        assert f"out={other} already holds {words}" in err and "choose another out" in err, err
        assert snapshot(other) == before


def test_prepare_output_refuses_a_link_in_process(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    link = tmp_path / "link"
    link.symlink_to(user)
    with pytest.raises(DraftsmithError, match=f"out={link} is a link to {user}"):
        mf.prepare_output(link, "eval", overwrite=True)


# --------------------------------------------------------------------------- the mechanism

def test_atomic_folder_keeps_foreign_files_and_drops_its_own_stale_ones(tmp_path):
    folder = tmp_path / "f"
    with mf.atomic_folder(folder) as tmp:
        (tmp / "a.bin").write_bytes(b"1")
        (tmp / "old").mkdir()
        (tmp / "old" / "stale.bin").write_bytes(b"2")
    hashes = plant(folder, ["mine.txt", "old/mine.txt", "dir/x/y.txt"])
    (folder / "empty").mkdir()
    (folder / "link").symlink_to(tmp_path / "elsewhere")
    with mf.atomic_folder(folder) as tmp:
        (tmp / "a.bin").write_bytes(b"3")
    survived(folder, hashes)
    assert (folder / "a.bin").read_bytes() == b"3" and not (folder / "old" / "stale.bin").exists()
    assert (folder / "empty").is_dir() and (folder / "link").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_atomic_folder_error_puts_everything_back(tmp_path):
    folder = tmp_path / "f"
    with mf.atomic_folder(folder) as tmp:
        (tmp / "a.bin").write_bytes(b"1")
    hashes = plant(folder, ["mine.txt", "d/mine.txt"])
    before = snapshot(folder)
    with pytest.raises(RuntimeError):
        with mf.atomic_folder(folder) as tmp:
            (tmp / "a.bin").write_bytes(b"2")
            raise RuntimeError("boom")
    assert snapshot(folder) == before
    survived(folder, hashes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_a_crash_mid_swap_is_recovered_without_losing_user_files(tmp_path):
    """Left by kill -9 between moving the old folder aside and renaming the new one in: the rerun puts the
    earlier output back with the user's files (moved into the new folder) and drops the temporaries."""
    folder = tmp_path / "f"
    with mf.atomic_folder(folder) as tmp:
        (tmp / "a.bin").write_bytes(b"1")
    hashes = plant(folder, ["mine.txt"])
    # simulate: new folder complete (with its record), the user's file already moved into it, old one aside
    new = tmp_path / ".f.abcdefgh.tmp"
    new.mkdir()
    (new / "a.bin").write_bytes(b"2")
    mf.write_record(new)
    os.replace(folder / "mine.txt", new / "mine.txt")
    aside = tmp_path / ".f.ijklmnop.old"
    aside.mkdir()
    os.replace(folder, aside / "f")
    with mf.atomic_folder(folder) as tmp:
        (tmp / "a.bin").write_bytes(b"3")
    survived(folder, hashes)
    assert (folder / "a.bin").read_bytes() == b"3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_remove_written_never_follows_a_link(tmp_path):
    outside = tmp_path / "outside"
    hashes = plant(outside, ["shard_00000.safetensors", "index.json"])
    folder = tmp_path / "hs"
    folder.mkdir()
    (folder / "shard_00001.safetensors").write_bytes(b"x")
    (folder / "sub").symlink_to(outside)
    mf.remove_written(folder, ("shard_*.safetensors", "index.json", "sub"))
    survived(outside, hashes)
    assert not folder.exists() or not (folder / "shard_00001.safetensors").exists()


def test_a_user_folder_where_the_new_output_has_a_file_is_refused_and_kept(tmp_path):
    folder = tmp_path / "f"
    hashes = plant(folder, ["config.json/mine.txt"])  # the user's folder where draftsmith writes a file
    with pytest.raises(DraftsmithError, match="is not draftsmith's, and the new output has a file in its way"):
        with mf.atomic_folder(folder) as tmp:
            (tmp / "config.json").write_text("{}")
    survived(folder, hashes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_clean_temporaries_leaves_what_only_looks_like_one(tmp_path):
    hashes = plant(tmp_path, [".f.abcdefgh.old/notes.txt", ".f.abcdefgh.old/other/x.txt"])  # not one folder named f
    mf.clean_temporaries(tmp_path, ["f"])
    survived(tmp_path, hashes)
