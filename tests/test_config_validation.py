"""Bad option values are refused with one sentence when a stage's config is built, before any work."""

from __future__ import annotations

import sys

import pytest
import torch

from draftsmith.core import DraftsmithError
from draftsmith.cli import main
from draftsmith.configs import check_config, compose

REFUSED = [
    # data-gen
    ("data_gen", ["temperature=-1"], "temperature=-1.0 must be at least 0"),
    ("data_gen", ["top_p=2"], "top_p=2.0 must be in (0, 1]"),
    ("data_gen", ["top_p=0"], "top_p=0.0 must be in (0, 1]"),
    ("data_gen", ["prompts.n=-1"], "prompts.n=-1 must be at least 1 (or null for all)"),
    ("data_gen", ["prompts.n=0"], "prompts.n=0 must be at least 1"),
    ("data_gen", ["max_new_tokens=0"], "max_new_tokens=0 must be at least 1"),
    ("data_gen", ["backend.batch_size=0"], "backend.batch_size=0 must be at least 1"),
    ("data_gen", ["backend.kind=bogus"], "backend.kind=bogus is not one of hf, openai"),
    ("data_gen", ["samples_per_shard=0"], "samples_per_shard=0 must be at least 1"),
    ("data_gen", ["on_overflow=bogus"], "on_overflow=bogus is not one of truncate, drop"),
    ("data_gen", ["hidden_states_dtype=bogus"], "hidden_states_dtype=bogus is not one of"),
    ("data_gen", ["reasoning=bogus"], "reasoning=bogus is not one of keep, strip"),
    ("data_gen", ["prompts.temperature=-0.5"], "prompts.temperature=-0.5 must be at least 0"),
    ("data_gen", ["prompts.top_p=0"], "prompts.top_p=0.0 must be in (0, 1]"),
    ("data_gen", ["prompts.top_p=1.5"], "prompts.top_p=1.5 must be in (0, 1]"),
    ("data_gen", ["prompts.source=bogus"], "prompts.source=bogus is not one of"),
    ("data_gen", ["max_length=0"], "max_length=0 must be at least 1"),
    ("data_gen", ["capture_batch_size=0"], "capture_batch_size=0 must be at least 1"),
    ("data_gen", ["target.dtype=bogus"], "target.dtype=bogus is not one of"),
    ("data_gen", ["target.device=bogus"], "target.device=bogus is not a torch device"),
    # train
    ("train", ["lr=-1"], "lr=-1.0 must be greater than 0"),
    ("train", ["lr=0"], "lr=0.0 must be greater than 0"),
    ("train", ["max_steps=0"], "max_steps=0 must be at least 1 (or null for epochs over the data)"),
    ("train", ["val_samples=-1"], "val_samples=-1 must be at least 0"),
    ("train", ["warmup_ratio=1"], "warmup_ratio=1.0 must be in [0, 1)"),
    ("train", ["warmup_ratio=-0.1"], "warmup_ratio=-0.1 must be in [0, 1)"),
    ("train", ["min_lr_ratio=1.5"], "min_lr_ratio=1.5 must be in [0, 1]"),
    ("train", ["epochs=0"], "epochs=0 must be at least 1"),
    ("data_gen", ["regenerate_chunk=0"], "regenerate_chunk=0 must be at least 1"),
    ("train", ["grad_clip=-1"], "grad_clip=-1.0 must be at least 0"),
    ("train", ["method.draft_vocab_size=0"], "method.draft_vocab_size=0 must be at least 1"),
    ("train", ["method.ttt_decay=0"], "method.ttt_decay=0.0 must be greater than 0"),
    ("train", ["method.ttt_steps=0"], "method.ttt_steps=0 must be at least 1"),
    ("train", ["method.feature_noise=-0.1"], "method.feature_noise=-0.1 must be at least 0"),
    ("train", ["method.norm_output=maybe"], "method.norm_output=maybe is not a valid boolean"),
    ("train", ["optimizer=sgd"], "optimizer=sgd is not one of adamw, muon"),
    ("train", ["muon_lr=0"], "muon_lr=0.0 must be greater than 0 (or null for lr)"),
    ("train", ["muon_momentum=1"], "muon_momentum=1.0 must be in [0, 1)"),
    ("train", ["muon_weight_decay=-1"], "muon_weight_decay=-1.0 must be at least 0"),
    ("train", ["optimizer=muon", "deepspeed=zero2"], "optimizer=muon runs with plain torch (deepspeed=none"),
    ("train", ["optimizer=muon", "precision=fp16", "deepspeed=none"], "optimizer=muon runs without DeepSpeed"),
    ("train", ["mode=bogus"], "mode=bogus is not one of auto, online, offline"),
    ("train", ["method=bogus"], "method=bogus is not an option of draftsmith train; choose from "),
    ("train", ["micro_batch_size=0"], "micro_batch_size=0 must be at least 1"),
    ("train", ["precision=fp8"], "precision=fp8 is not one of auto, fp32, bf16, fp16"),
    ("train", ["precision=fp16", "deepspeed=none"], "precision=fp16 needs DeepSpeed's loss scaling"),
    ("train", ["deepspeed.config=zero9"], "deepspeed.config=zero9 is not one of auto, none, zero1, zero2, zero3"),
    ("train", ["wandb.mode=bogus"], "wandb.mode=bogus is not one of"),
    ("train", ["target.dtype=bogus"], "target.dtype=bogus is not one of"),
    # eval
    ("eval", ["max_new_tokens=0"], "max_new_tokens=0 must be at least 1"),
    ("eval", ["repeats=0"], "repeats=0 must be at least 1"),
    ("eval", ["temperature=-1"], "temperature=-1.0 must be >= 0"),
    ("eval", ["top_p=2"], "top_p=2.0 must be in (0, 1]"),
    ("eval", ["top_k=-1"], "top_k=-1 must be >= 0"),
    ("eval", ["prompts.source=holdout", "prompts.holdout=0"], "prompts.holdout=0 must be at least 1"),
    ("eval", ["prompts.n=-1"], "prompts.n=-1 must be at least 1"),
    ("eval", ["prompts.per_category=0"], "prompts.per_category=0 must be at least 1"),
    ("eval", ["drafting.mode=bogus"], "drafting.mode='bogus' must be 'chain' or 'tree'"),
    ("eval", ["drafting.num_speculative_tokens=0"], "drafting.num_speculative_tokens=0 must be in 1..64"),
    ("eval", ["baselines=[bogus]"], "baselines has 'bogus'"),
    ("eval", ["ngram_min=4"], "ngram_min=4 and ngram_max=3"),
    ("eval", ["max_len=0"], "max_len=0 must be at least 1"),
    # export, demo
    ("export", ["format=bogus"], "format=bogus is not one of eagle3, speculators"),
    ("export", ["dtype=bogus"], "dtype=bogus is not one of"),
    ("export", ["num_speculative_tokens=0"], "num_speculative_tokens=0 must be at least 1"),
    ("export", ["speculative_tokens=4"], "option speculative_tokens of draftsmith export is now num_speculative_tokens"),
    ("publish", ["speculative_tokens=4"], "option speculative_tokens of draftsmith publish is now num_speculative_tokens"),
    ("demo", ["flavour=bogus"], "flavour=bogus is not one of smollm2, smollm2-fixed, smollm2-long, tiny"),
    ("demo", ["train_steps=0"], "train_steps=0 must be at least 1"),
    ("demo", ["num_speculative_tokens=0"], "num_speculative_tokens=0 must be in [1, 64]"),
    # keys and types
    ("train", ["+a_typo=1"], "unknown option a_typo for draftsmith train"),
    ("train", ["+lrr=1"], "unknown option lrr for draftsmith train; did you mean lr?"),
    ("data_gen", ["prompts.nn=3"], "unknown option prompts.nn for draftsmith data-gen; did you mean prompts.n?"),
    ("data_gen", ["+target.nme=x"], "unknown option target.nme for draftsmith data-gen; did you mean target.name?"),
    ("eval", ["+prompts.holdot=3"], "did you mean prompts.holdout?"),
    ("train", ["method=eagle3", "method.draft_vocab_sise=10"], "did you mean method.draft_vocab_size?"),
    ("train", ["lr=abc"], "lr=abc is not a valid number"),
    ("data_gen", ["prompts.n=abc"], "prompts.n=abc is not a valid integer"),
    ("train", ["progress=maybe"], "progress=maybe is not a valid boolean"),
    ("data_gen", ["target=bogus"], "target=bogus is not an option of draftsmith data-gen; choose from hf, smollm2, tiny"),
]


@pytest.mark.parametrize("stage,overrides,expected", REFUSED, ids=lambda x: x if isinstance(x, str) else None)
def test_refused_at_build(stage, overrides, expected):
    with pytest.raises(DraftsmithError) as e:
        compose(stage, overrides)
    msg = str(e.value)
    assert expected in msg and "\n" not in msg and msg.endswith((".", "?")), msg


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("stage,key", [("train", "device"), ("train", "target.device"), ("data_gen", "target.device"),
                                       ("eval", "target.device")])
def test_cuda_without_cuda(no_cuda, stage, key):
    with pytest.raises(DraftsmithError) as e:
        compose(stage, [f"{key}=cuda"])
    assert str(e.value) == (f"{key}=cuda was asked for but this machine has no CUDA device "
                            "(torch.cuda.is_available() is False).")


@pytest.fixture
def cli(capsys, monkeypatch):
    """cli(*argv) -> the one stderr line of a refused command (exit code 2)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))

    def refuse(*argv) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(list(argv))
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1, err
        return err[0]

    return refuse


@pytest.mark.parametrize("stage,overrides,expected", [r for r in REFUSED if r[0] != "demo"][::4],
                         ids=lambda x: x if isinstance(x, str) else None)
def test_cli_refuses_with_one_line(cli, stage, overrides, expected):
    command = stage.replace("_", "-")
    required = {"train": ["data=/nonexistent"], "export": ["head=/nonexistent"], "eval": ["prompts.path=/x"]}
    line = cli(command, *required.get(stage, []), *overrides)
    assert line.startswith(f"draftsmith {command}: error: ") and expected in line, line


def test_cli_cuda_without_cuda(cli, no_cuda):
    line = cli("train", "data=/nonexistent", "device=cuda")
    assert line == ("draftsmith train: error: device=cuda was asked for but this machine has no CUDA device "
                    "(torch.cuda.is_available() is False).")


def test_required_options_at_the_cli(cli):
    assert cli("train", "target=tiny") == "draftsmith train: error: data= is required: a data-gen output folder."
    assert cli("export") == "draftsmith export: error: head= is required: the folder written by draftsmith train."
    assert cli("data-gen", "prompts=sharegpt") == \
        "draftsmith data-gen: error: prompts=sharegpt needs a file: set prompts.path=<file.jsonl>."
    assert cli("data-gen", "target=hf") == \
        "draftsmith data-gen: error: target=hf needs target.name=<HF folder, hub id or .gguf file>."
    assert cli("eval") == "draftsmith eval: error: prompts.source=question needs prompts.path=<file or folder>."
    # compose leaves them to the caller: every shipped option composes on its own
    compose("train", [])
    compose("data_gen", ["target=hf", "prompts=hf"])


def test_check_config_takes_dataclasses_and_refuses_missing():
    from draftsmith.train.config import TrainConfig
    from draftsmith.train.eagle3 import Eagle3Config

    with pytest.raises(DraftsmithError, match=r"^data= is required"):
        check_config("train", TrainConfig())
    check_config("train", TrainConfig(data="/x", method=Eagle3Config()))
    with pytest.raises(DraftsmithError, match=r"^lr=-1"):
        TrainConfig(data="/x", lr=-1)


def test_train_config_names_no_method():
    """The default method is configs/train.yaml's choice alone: TrainConfig in code names none, and a run without one
    is refused in one sentence, not trained as EAGLE-3."""
    from omegaconf import OmegaConf

    from draftsmith.core.methods import trainable
    from draftsmith.train.config import TrainConfig

    assert OmegaConf.is_missing(OmegaConf.structured(TrainConfig(data="/x")), "method")
    expected = f"method= is required: one of {', '.join(trainable())} (`draftsmith train method=<name>`; in code, "
    for cfg in (TrainConfig(data="/x"), OmegaConf.structured(TrainConfig(data="/x"))):
        with pytest.raises(DraftsmithError) as e:
            check_config("train", cfg)  # what the CLI runs once, before train's run (which takes the checked tree)
        assert str(e.value).startswith(expected) and str(e.value).count(". ") == 0
    for name in trainable():  # the YAML picks the method; its options are typed by the method's own Config
        cfg = compose("train", ["data=/x", f"method={name}"])
        assert cfg.method.name == name and OmegaConf.get_type(cfg.method).__module__ == f"draftsmith.train.{name}"
    assert compose("train", ["data=/x"]).method.name == "eagle3"  # configs/train.yaml's default


def test_target_dtype_has_one_default():
    """TargetConfig() and every stage's target default to dtype auto (resolved per machine when the target loads)."""
    import dataclasses

    from draftsmith.data_gen.config import DataGenConfig
    from draftsmith.data_gen.target import TargetConfig
    from draftsmith.eval.config import EvalConfig
    from draftsmith.train.config import TrainConfig

    assert TargetConfig().dtype == "auto"
    for cls in (DataGenConfig, TrainConfig, EvalConfig):
        target = next(f for f in dataclasses.fields(cls) if f.name == "target")
        assert target.default_factory is TargetConfig, cls
    assert compose("train", ["data=/x"]).target.dtype == compose("data_gen").target.dtype == "auto"
    assert compose("eval", ["prompts.path=/x"]).target.dtype == "auto"


def test_train_validate_uses_the_shared_checks():
    from omegaconf import OmegaConf

    from draftsmith.train.config import TrainConfig
    from draftsmith.train.eagle3 import Eagle3Config

    cfg = OmegaConf.structured(TrainConfig(data="/x", method=Eagle3Config()))
    cfg.max_steps = 0
    with pytest.raises(DraftsmithError, match=r"^max_steps=0 must be at least 1"):
        check_config("train", cfg)


def test_eval_build_settings_still_checks():
    from omegaconf import OmegaConf

    from draftsmith.eval.config import EvalConfig, build_settings

    cfg = OmegaConf.structured(EvalConfig())
    sampling, drafting = build_settings(cfg)
    assert sampling.greedy and drafting.mode == "chain"
    cfg.repeats = 0
    with pytest.raises(DraftsmithError, match=r"^repeats=0"):
        build_settings(cfg)


def test_good_values_compose():
    compose("data_gen", ["temperature=0.7", "top_p=0.9", "prompts.n=null", "max_new_tokens=1", "on_overflow=drop",
                         "reasoning=strip", "hidden_states_dtype=float16", "target.dtype=bf16"])
    compose("train", ["data=/x", "lr=3e-4", "max_steps=null", "warmup_ratio=0", "min_lr_ratio=1", "grad_clip=0",
                      "deepspeed.config=my/ds.json", "precision=fp16", "val_samples=0"])
    compose("eval", ["prompts.source=holdout", "prompts.holdout=4", "prompts.path=/x", "temperature=0.5", "top_k=5"])
