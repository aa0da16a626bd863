"""The console script: --version, per-stage --help with defaults and descriptions, Hydra's flags, one-line errors."""

from __future__ import annotations

import sys

import pytest

from draftsmith.cli import SUBCOMMANDS, main, option_rows
from draftsmith.configs import compose, schema


@pytest.fixture(autouse=True)
def keep_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() hands its overrides to Hydra through sys.argv


def _exit(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_version(capsys):
    assert _exit(capsys, "--version") == (0, "draftsmith 0.1.0\n", "")
    assert _exit(capsys, "train", "--version")[:2] == (0, "draftsmith 0.1.0\n")


def test_train_help_lists_options_with_defaults_and_descriptions(capsys):
    code, out, _ = _exit(capsys, "train", "--help")
    assert code == 0
    lines = out.splitlines()

    def row(option: str) -> str:
        (line,) = [ln for ln in lines if ln.strip().startswith(option + "=")]
        return line

    assert "peak learning rate" in row("lr") and "lr=0.0001" in row("lr")
    assert "length bucketing" in row("mega_batch") and "mega_batch=64" in row("mega_batch")
    assert not [ln for ln in lines if ln.strip().startswith("fail_at_step=")]  # the tests' crash lives in the tests
    assert "(required)" in row("data") and "data=???" in row("data")
    assert "target.name=smollm2" in row("target.name")
    assert "deepspeed.config=auto" in row("deepspeed.config")  # (was zero2: deepspeed=auto is the default now)
    assert "wandb.mode=auto" in row("wandb.mode")
    assert "deepspeed=auto|none|zero1|zero2|zero3" in out and "target=hf|smollm2|tiny" in out


def test_help_defaults_follow_the_stage_yaml(capsys):
    _, data_gen, _ = _exit(capsys, "data-gen", "--help")
    _, evals, _ = _exit(capsys, "eval", "-h")
    assert "  prompts.n=64 " in data_gen and "  prompts.n=16 " in evals
    assert "prompts.holdout=16" in evals and "prompts.holdout" not in data_gen


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_option_has_a_description(command):
    config_name = SUBCOMMANDS[command][1]
    rows = list(option_rows(schema(config_name), compose(config_name)))
    assert rows
    undocumented = [name for name, _, doc in rows if not doc or doc == "(required)"]
    assert not undocumented, f"{command}: add a `# comment` to {undocumented}"


def test_unknown_key_with_plus_is_refused(capsys):
    code, _, err = _exit(capsys, "train", "data=/x", "+a_typo=1")
    assert code == 2
    assert err.strip() == "draftsmith train: error: unknown option a_typo for draftsmith train; " \
                          "`draftsmith train --help` lists the options."
    code, _, err = _exit(capsys, "train", "data=/x", "+max_step=3")
    assert err.strip() == "draftsmith train: error: unknown option max_step for draftsmith train; did you mean max_steps?"


def test_wrong_type_is_one_sentence(capsys):
    code, _, err = _exit(capsys, "train", "data=/x", "lr=abc")
    assert code == 2 and err.strip() == "draftsmith train: error: lr=abc is not a valid number."


def test_hydra_cfg_flag_still_prints_the_config(capsys):
    capsys.readouterr()
    main(["train", "target=tiny", "--cfg", "job"])  # data= may stay unset when only printing
    out = capsys.readouterr().out
    assert "method:\n  name: eagle3\n  draft_vocab_size: 32000" in out and "name: tiny" in out
    code, _, err = _exit(capsys, "train", "lr=abc", "--cfg", "job")
    assert code == 2 and "lr=abc" in err


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_ctrl_c_is_one_line_that_says_how_to_go_on(capsys, monkeypatch, command):
    """A KeyboardInterrupt inside any stage exits 130 with one line naming the command and what a rerun does."""
    import importlib

    from draftsmith.cli import AFTER_INTERRUPT

    stage = importlib.import_module(SUBCOMMANDS[command][0])

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(stage, "run", interrupted)
    monkeypatch.setattr("draftsmith.configs.check_config", lambda name, cfg, **kw: cfg)  # no real data, head or target
    code, out, err = _exit(capsys, command)
    assert code == 130 and out == ""
    assert err == f"draftsmith {command}: interrupted; {AFTER_INTERRUPT[command]}\n"
