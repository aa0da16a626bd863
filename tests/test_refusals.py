"""Untrusted folders through the CLI: one sentence on stderr, exit code 2, no traceback, for
a symlinked or truncated weights file (heads, draft models, training checkpoints), a target or draft folder that
needs its own code (auto_map) without trust_remote_code, a draft model with only pickled weights, and a chat
template that raises, does not parse, loops past the sandbox's range limit or tries to escape the sandbox."""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest

from draftsmith.cli import main
from helpers import crash_after_step, save_tiny_head

QUESTIONS = [{"question_id": 1, "category": "math", "turns": ["What is 2+2?"]}]
PUBLISH = ["repo_id=someone/tiny-head", "base_model=someone/tiny-base", "license=mit", "allow_no_eval=true",
           "dry_run=true"]
EAGLE3_TRAIN = ["method=eagle3", "target=tiny", "wandb.mode=disabled", "progress=false", "deepspeed=none",
                "method.draft_vocab_size=64", "method.ttt_steps=2", "micro_batch_size=2"]


@pytest.fixture(autouse=True)
def keep_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() hands its overrides to Hydra through sys.argv


def refused(capsys, *argv) -> str:
    """Run `draftsmith <argv>`: exit code 2 and one line on stderr, no traceback; returns the sentence."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and "examples/s" not in ln]
    assert "Traceback" not in err, err
    assert e.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"draftsmith {argv[0]}: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny EAGLE-3 head, the tiny target saved as an HF folder (also a draft model: same tokenizer), prompts,
    tiny training data."""
    from draftsmith.data_gen.target import TargetConfig, load_target
    from helpers import make_tiny_data

    root = tmp_path_factory.mktemp("refusals")
    target = load_target(TargetConfig(name="tiny", dtype="float32"))
    save_tiny_head(root / "head")
    target.model.save_pretrained(root / "hf")
    target.tokenizer.save_pretrained(root / "hf")
    (root / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    make_tiny_data(root / "data", target, n=8)
    return root


def copy(base, name, tmp_path) -> Path:
    dst = tmp_path / name
    shutil.copytree(base / name, dst)
    return dst


def stage_args(stage, head, base, tmp_path):
    if stage == "eval":
        return ["eval", "target=tiny", f"head={head}", "prompts=question", f"prompts.path={base / 'q.jsonl'}",
                f"out={tmp_path / 'eval-out'}", "progress=false"]
    if stage == "export":
        return ["export", f"head={head}", f"out={tmp_path / 'export-out'}"]
    return ["publish", f"head={head}", *PUBLISH, f"out={tmp_path / 'hub-out'}"]


# ---- weights files ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["head", "hf"])
@pytest.mark.parametrize("stage", ["eval", "export", "publish"])
def test_symlinked_weights_are_refused(base, tmp_path, capsys, stage, kind):
    folder = copy(base, kind, tmp_path)
    weights = folder / "model.safetensors"
    elsewhere = tmp_path / "elsewhere.safetensors"  # a valid file: only the link is wrong
    weights.rename(elsewhere)
    weights.symlink_to(elsewhere)
    line = refused(capsys, *stage_args(stage, folder, base, tmp_path))
    assert str(weights) in line and "symbolic link" in line
    assert not (tmp_path / "export-out").exists() and not (tmp_path / "hub-out").exists()


@pytest.mark.parametrize("kind", ["head", "hf"])
@pytest.mark.parametrize("stage", ["eval", "export", "publish"])
def test_truncated_weights_are_refused(base, tmp_path, capsys, stage, kind):
    folder = copy(base, kind, tmp_path)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    line = refused(capsys, *stage_args(stage, folder, base, tmp_path))
    assert str(weights) in line and "truncated" in line


def test_truncated_checkpoint_is_refused_on_resume(base, tmp_path, capsys):
    from draftsmith.configs import compose
    from draftsmith.train.run import run

    args = [*EAGLE3_TRAIN, f"data={base / 'data'}", f"out={tmp_path / 'out'}", "max_steps=3", "save_every=1"]
    with crash_after_step(2), pytest.raises(RuntimeError, match="simulated crash"):
        run(compose("train", args))
    (last,) = sorted((tmp_path / "out" / "checkpoints").glob("step_*"))[-1:]
    weights = last / "head.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    line = refused(capsys, "train", *args, "resume=true")
    assert str(weights) in line and "truncated" in line


# ---- code a folder would run -------------------------------------------------------------------------------


def with_tokenizer_auto_map(folder: Path) -> Path:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}, tokenizer_class="EvilTokenizer")
    path.write_text(json.dumps(config))
    (folder / "tokenization_evil.py").write_text(f"open({str(folder / 'RAN')!r}, 'w').close()\n")
    return path


def with_config_auto_map(folder: Path) -> Path:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}, model_type="evil")
    path.write_text(json.dumps(config))
    for name in ("configuration_evil.py", "modeling_evil.py"):
        (folder / name).write_text(f"open({str(folder / 'RAN')!r}, 'w').close()\n")
    return path


TARGET_STAGES = {
    "data-gen": lambda f, base, tmp: ["data-gen", "target=hf", f"target.name={f}", "target.dtype=float32",
                                      "prompts=question", f"prompts.path={base / 'q.jsonl'}", f"out={tmp / 'o'}"],
    "train": lambda f, base, tmp: ["train", *[a for a in EAGLE3_TRAIN if a != "target=tiny"], "target=hf",
                                   f"target.name={f}", "target.dtype=float32", f"data={base / 'data'}",
                                   f"out={tmp / 'o'}", "max_steps=1"],
    "eval": lambda f, base, tmp: ["eval", "target=hf", f"target.name={f}", "target.dtype=float32", "head=ngram",
                                  "prompts=question", f"prompts.path={base / 'q.jsonl'}", f"out={tmp / 'o'}",
                                  "progress=false"],
}


@pytest.mark.parametrize("where", ["tokenizer", "config"])
@pytest.mark.parametrize("stage", sorted(TARGET_STAGES))
def test_target_needing_its_own_code_is_refused(base, tmp_path, capsys, stage, where):
    folder = copy(base, "hf", tmp_path)
    path = (with_tokenizer_auto_map if where == "tokenizer" else with_config_auto_map)(folder)
    line = refused(capsys, *TARGET_STAGES[stage](folder, base, tmp_path))
    assert str(path) in line and "auto_map" in line and "target.trust_remote_code=true" in line
    assert not (folder / "RAN").exists()


def draft_model_args(stage: str, folder, base, tmp_path) -> list[str]:
    """The command line of `stage` reading the draft-model `folder` (train: as the init of method=draft)."""
    if stage != "train":
        return stage_args(stage, folder, base, tmp_path)
    return ["train", "method=draft", "target=tiny", "wandb.mode=disabled", "progress=false", "deepspeed=none",
            "method.init=from_model", f"method.model={folder}", f"data={base / 'data'}", f"out={tmp_path / 'o'}",
            "max_steps=1", "micro_batch_size=2"]


# eval reads a draft model's weights and config, never its tokenizer: no (eval, tokenizer) case.
@pytest.mark.parametrize("stage,where", [(stage, where) for stage in ("eval", "export", "publish", "train")
                                         for where in ("tokenizer", "config") if (stage, where) != ("eval", "tokenizer")])
def test_draft_model_needing_its_own_code_is_refused(base, tmp_path, capsys, stage, where):
    folder = copy(base, "hf", tmp_path)
    path = (with_tokenizer_auto_map if where == "tokenizer" else with_config_auto_map)(folder)
    args = draft_model_args(stage, folder, base, tmp_path)
    line = refused(capsys, *args)
    assert str(path) in line and "auto_map" in line
    assert not (folder / "RAN").exists()


class Payload:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


@pytest.mark.parametrize("stage", ["eval", "export", "publish", "train"])
def test_draft_model_with_only_pickled_weights_is_refused(base, tmp_path, capsys, stage):
    folder = copy(base, "hf", tmp_path)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "UNPICKLED"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": Payload(marker)}))
    args = draft_model_args(stage, folder, base, tmp_path)
    line = refused(capsys, *args)
    assert str(folder / "pytorch_model.bin") in line and "safetensors" in line and "convert" in line
    assert not marker.exists()


# ---- chat templates --------------------------------------------------------------------------------------

TEMPLATES = {
    "raises": ("{{ raise_exception('this template refuses') }}", "this template refuses"),
    "syntax": ("{% for m in messages %}{{ m.content }", "unexpected '}'"),
    "range": ("{% for i in range(200000) %}x{% endfor %}", "range"),
    "escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
}


@pytest.mark.parametrize("case", sorted(TEMPLATES))
@pytest.mark.parametrize("stage", ["data-gen", "eval"])
def test_bad_chat_template_is_one_sentence(base, tmp_path, capsys, stage, case):
    template, said = TEMPLATES[case]
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    common = ["target=tiny", f"target.chat_template={path}", "prompts=question", f"prompts.path={base / 'q.jsonl'}",
              f"out={tmp_path / 'o'}"]
    args = ["data-gen", *common, "max_new_tokens=4"] if stage == "data-gen" else \
        ["eval", *common, "head=ngram", "progress=false", "max_new_tokens=4"]
    line = refused(capsys, *args)
    assert str(path) in line and said in line and "chat template" in line


def test_bad_chat_template_of_a_folder_names_its_file(base, tmp_path, capsys):
    folder = copy(base, "hf", tmp_path)
    (folder / "chat_template.jinja").write_text(TEMPLATES["raises"][0])
    line = refused(capsys, *TARGET_STAGES["data-gen"](folder, base, tmp_path))
    assert str(folder / "chat_template.jinja") in line and "this template refuses" in line
