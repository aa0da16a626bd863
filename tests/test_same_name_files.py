"""overwrite=true never replaces a user's file, same-named ones included; every refusal is one sentence (issue 49).

For each stage (data-gen, train, eval, export, publish dry run, demo flavour=tiny) a user's folder holds files under
the names the stage writes: with overwrite=true the stage refuses before any work, with one sentence naming the
file, and the folder's bytes (sha256 of every file) are unchanged and nothing is added. A stage's own earlier output
stays rewritable. Then the refusals of values Hydra cannot parse (`out=~`, a line break, ';', '~/'), base_model=../..,
TRANSFORMERS_OFFLINE alone and backend.url=ftp://: one sentence naming the option and the value, no Hydra exception.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from draftsmith.cli import main
from draftsmith.core import DraftsmithError
from draftsmith.core import artifacts as mf
from helpers import save_tiny_head

QUESTIONS = [{"question_id": 1, "category": "math", "turns": ["What is 2+2?"]}]
TRAIN = ["train", "method=eagle3", "target=tiny", "wandb.mode=disabled", "progress=false", "deepspeed=none",
         "method.draft_vocab_size=64", "method.ttt_steps=2", "micro_batch_size=2", "max_steps=2"]
PUBLISH = ["repo_id=someone/tiny-head", "base_model=someone/tiny-base", "license=mit", "allow_no_eval=true",
           "dry_run=true"]


@pytest.fixture(autouse=True)
def keep_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() hands its overrides to Hydra through sys.argv


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny EAGLE-3 head and a prompts file (read only)."""
    root = tmp_path_factory.mktemp("same-name")
    save_tiny_head(root / "head")
    (root / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return root


def refused(capsys, *argv) -> str:
    """Run `draftsmith <argv>`: exit code 2 and one line on stderr, no traceback; returns the sentence."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and "examples/s" not in ln]
    assert "Traceback" not in err and "Exception" not in err, err
    assert e.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"draftsmith {argv[0]}: error: "), err
    return lines[0]


def plant(folder: Path, rels) -> dict[str, str]:
    """A user's file (distinct bytes) at each relative path under `folder`; {path: sha256}."""
    for rel in rels:
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"the user's own {rel}\n".encode() + os.urandom(16))
    return checksums(folder)


def checksums(folder: Path) -> dict[str, str]:
    """sha256 of every entry under `folder` (folders as 'dir'): a refusal must leave exactly these."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def stage_args(stage: str, base: Path, out: Path) -> list[str]:
    args = {
        "data-gen": ["data-gen", "target=tiny", "prompts=question", f"prompts.path={base / 'q.jsonl'}",
                     "max_new_tokens=6"],
        "train": [*TRAIN, f"data={base / 'data-not-needed-before-the-refusal'}"],
        "eval": ["eval", "target=tiny", "head=ngram", "prompts=question", f"prompts.path={base / 'q.jsonl'}",
                 "max_new_tokens=6", "repeats=1", "progress=false", "plot=false"],
        "export": ["export", f"head={base / 'head'}"],
        "publish": ["publish", f"head={base / 'head'}", *PUBLISH],
        "demo": ["demo", "flavour=tiny", "progress=false"],
    }[stage]
    return [*args, f"out={out}", "overwrite=true"]


# The table (and export's own names): the user's files under names each stage writes, all named by the
# one sentence
SAME_NAMES = {
    "data-gen": ["config.yaml"],
    "train": ["config.yaml", "metrics.jsonl"],
    "eval": ["config.yaml", "report.json", "report.md"],
    "export": ["config.json", "model.safetensors"],
    "publish": ["README.md"],
    "demo": ["config.yaml", "data/config.yaml", "head/config.yaml"],
}


@pytest.mark.parametrize("stage", list(SAME_NAMES))
def test_a_users_same_named_files_are_refused_and_kept_with_overwrite(stage, base, tmp_path, capsys):
    user = tmp_path / "user"
    before = plant(user, [*SAME_NAMES[stage], "notes.txt"])
    err = refused(capsys, *stage_args(stage, base, user))
    assert all(str(user / rel) in err for rel in SAME_NAMES[stage]) and "never replaces" in err, err
    assert checksums(user) == before  # the bytes, and nothing added (no owner file: the folder is not claimed)


@pytest.mark.parametrize("rel", ["data/config.yaml", "head/config.yaml", "head/metrics.jsonl", "eval/report.json"])
def test_demo_names_a_same_named_file_in_its_stage_folders(rel, base, tmp_path, capsys):
    user = tmp_path / "user"
    before = plant(user, [rel, "data/mine.txt", "notes.txt"])
    err = refused(capsys, *stage_args("demo", base, user))
    assert str(user / rel) in err, err
    assert checksums(user) == before


def test_train_names_a_same_named_head_file_in_final(base, tmp_path, capsys):
    user = tmp_path / "user"
    before = plant(user, ["final/model.safetensors", "final/mine.txt"])
    err = refused(capsys, *stage_args("train", base, user))
    assert str(user / "final" / "model.safetensors") in err, err
    assert checksums(user) == before


def test_the_stages_own_earlier_output_stays_rewritable(tmp_path):
    """Its names in a folder the stage owns are its own: accepted, overwrite or not."""
    own = tmp_path / "own"
    plant(own, ["config.yaml", "report.json", "report.md"])
    mf.claim_output(own, "eval")
    for overwrite in (False, True):
        assert mf.prepare_output(own, "eval", overwrite=overwrite) == own
    user = tmp_path / "user"
    plant(user, ["config.yaml"])
    with pytest.raises(DraftsmithError, match=f"{user / 'config.yaml'} is a file of yours under a name draftsmith "
                                              f"eval writes"):
        mf.prepare_output(user, "eval", overwrite=True)


def test_a_whole_folder_swap_refuses_a_users_file_of_a_name_it_writes(tmp_path):
    """The swap (atomic_folder) never replaces a file its record does not list: a user's, or one in a folder
    without a record; its own recorded files are replaced as before."""
    folder = tmp_path / "f"
    before = plant(folder, ["config.json", "mine.txt"])
    with pytest.raises(DraftsmithError, match=f"{folder / 'config.json'} is a file draftsmith did not write"):
        with mf.atomic_folder(folder) as tmp:
            (tmp / "config.json").write_text("{}")
    assert checksums(folder) == before and sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    own = tmp_path / "own"
    with mf.atomic_folder(own) as tmp:
        (tmp / "config.json").write_text("1")
    with mf.atomic_folder(own) as tmp:
        (tmp / "config.json").write_text("2")
    assert (own / "config.json").read_text() == "2"


def test_data_gen_declares_every_name_it_writes():
    """core's WRITES["data_gen"] spells data_gen/run.py's TEMPORARIES (the names data-gen writes in each folder)."""
    from draftsmith.data_gen.run import SUBFOLDERS, TEMPORARIES

    declared = set(mf.WRITES["data_gen"])
    for folder, names in TEMPORARIES.items():
        for name in names:
            if folder == "" and (name in SUBFOLDERS and name != "parts" or name == mf.OWNER):
                continue  # a folder whose files are declared one by one, or the claim itself
            assert (f"{folder}/{name}" if folder else name) in declared, (folder, name)


# --------------------------------------------------------------------------- refusals as one sentence


@pytest.mark.parametrize("stage", ["data-gen", "eval", "publish", "demo"])
def test_out_tilde_is_one_sentence(stage, base, tmp_path, capsys):
    err = refused(capsys, *stage_args(stage, base, tmp_path / "x")[:-2], "out=~")
    assert "out=~ holds '~'" in err and f"out={Path.home()}/" in err and "Lexer" not in err, err


@pytest.mark.parametrize("option, value, words", [
    ("repo_id", "someone/a\nb", "repo_id=someone/a\\nb holds a line break"),
    ("license", "mit\nx", "license=mit\\nx holds a line break"),
    ("repo_id", "someone/a;b", "repo_id=someone/a;b holds ';'"),
    ("license", "mit;x", "license=mit;x holds ';'"),
    ("repo_id", "~/someone", "repo_id=~/someone holds '~'"),
    ("license", "~/mit", "license=~/mit holds '~'"),
])
def test_a_value_hydra_cannot_parse_is_one_sentence(option, value, words, base, tmp_path, capsys):
    err = refused(capsys, "publish", f"head={base / 'head'}", *PUBLISH, f"{option}={value}", f"out={tmp_path / 'o'}")
    assert words in err and f"{option} takes" in err and "Lexer" not in err, err
    assert not (tmp_path / "o").exists()


def test_base_model_path_is_refused_as_that_value(base, tmp_path, capsys):
    err = refused(capsys, "publish", f"head={base / 'head'}", *PUBLISH, "base_model=../../x", f"out={tmp_path / 'o'}")
    assert "base_model='../../x' is not a Hub model id (a local path)" in err and "target" in err, err


def test_a_quoted_license_that_is_no_license_id_is_one_sentence(base, tmp_path, capsys):
    err = refused(capsys, "publish", f"head={base / 'head'}", *PUBLISH, "license='mit;x'", f"out={tmp_path / 'o'}")
    assert "license='mit;x' is not a Hub license id" in err, err


def test_offline_refusal_names_the_variable_that_is_set(base, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    args = [a for a in PUBLISH if a != "dry_run=true"]
    err = refused(capsys, "publish", f"head={base / 'head'}", *args, f"out={tmp_path / 'o'}")
    assert "TRANSFORMERS_OFFLINE is set" in err and "unset TRANSFORMERS_OFFLINE" in err and "HF_HUB" not in err, err
    assert not (tmp_path / "o").exists()


def test_a_backend_url_that_is_not_http_is_refused_up_front(base, tmp_path, capsys):
    err = refused(capsys, "data-gen", "target=tiny", "prompts=question", f"prompts.path={base / 'q.jsonl'}",
                  "backend.kind=openai", "backend.url=ftp://127.0.0.1:8000/v1", f"out={tmp_path / 'o'}")
    assert "backend.url=ftp://127.0.0.1:8000/v1 is not an http:// or https:// URL" in err, err
    assert not (tmp_path / "o").exists()
