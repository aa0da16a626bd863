"""The method table: a throwaway method added as files plus one row (tests/throwaway_method/, outside the package;
no draftsmith file edited) is built, trained two steps on the tiny target, saved, decoded by eval and exported;
stages find methods only through the table."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from helpers import eval_cfg, make_tiny_data
from throwaway_method import bigram_folders, bigram_proposer, train_bigram
from throwaway_method.bigram import ARCH, Bigram
from throwaway_method.bigram_folders import save_bigram
from throwaway_method.train_bigram import BigramConfig

from draftsmith.core import DraftsmithError, methods
from draftsmith.configs import compose


@pytest.fixture
def bigram_method():
    entry = methods.Method("bigram", folders=lambda: bigram_folders.HOOKS, proposers=lambda: bigram_proposer.proposer,
                           train=lambda: train_bigram.HOOKS)
    methods.register(entry)
    # the method is its own files, all outside draftsmith, plus this row: no draftsmith file was edited for it
    for hook in (entry.folders().load, entry.trainable().new_drafter, entry.proposers()):
        module = sys.modules[hook.__module__]
        assert not module.__name__.startswith("draftsmith.")
        assert Path(module.__file__).resolve().parent == Path(__file__).resolve().parent / "throwaway_method"
    yield entry
    del methods.methods()["bigram"]


def test_a_throwaway_method_trains_decodes_and_exports(bigram_method, tiny_target, questions, tmp_path, one_thread):
    from draftsmith.eval.run import run as eval_run
    from draftsmith.export import ExportConfig, run as export_run
    from draftsmith.train.run import run as train_run

    data = make_tiny_data(tmp_path / "data", tiny_target, n=8)
    cfg = compose("train", ["target=tiny", f"data={data}", f"out={tmp_path / 'run'}", "max_steps=2",
                            "deepspeed=none", "wandb.mode=disabled", "progress=false", "micro_batch_size=2"])
    cfg.method = BigramConfig(hidden=8)  # what method=bigram would compose and check
    result = train_run(cfg)
    assert result["method"] == "bigram" and result["steps"] == 2
    metrics = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["loss_0"] > 0 for m in metrics)
    final = tmp_path / "run" / "final"
    assert json.loads((final / "config.json").read_text())["architectures"] == [ARCH]

    report = eval_run(eval_cfg(questions, tmp_path / "eval", f"head={final}", "drafting.num_speculative_tokens=2"))
    assert report["method"] == "bigram"
    assert report["greedy_identical_fraction"] == 1.0  # lossless whatever the drafter proposes

    out = export_run(ExportConfig(head=str(final), format="bigram_bin", out=str(tmp_path / "exported")))
    exported = load_file(str(Path(out) / "model.safetensors"))
    assert torch.equal(exported["embed.weight"], load_file(str(final / "model.safetensors"))["embed.weight"])


def test_export_refuses_a_format_of_another_method(bigram_method, tmp_path):
    from draftsmith.export import ExportConfig, run as export_run

    folder = tmp_path / "bigram"
    save_bigram(Bigram(SimpleNamespace(vocab_size=32, hidden=4)), folder, None)
    with pytest.raises(DraftsmithError, match="format=speculators is not a format of bigram heads"):
        export_run(ExportConfig(head=str(folder), format="speculators", out=str(tmp_path / "o")))


def test_stages_do_not_name_methods():
    """No stage run branches on a method name or architecture: they look methods up in the table."""
    root = Path(__file__).resolve().parents[1]
    for stage in ("train/run.py", "eval/run.py", "commands/export.py", "train/trainer.py"):
        text = (root / stage).read_text()
        for word in ("Eagle3", "EAGLE3", '"eagle3"', "'eagle3'"):  # classes, architectures, names as values
            assert word not in text, f"{stage} names {word}"
