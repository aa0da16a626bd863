"""The method table: a throwaway method added as one entry (no stage run edited) is built, trained two
steps on the tiny target, saved, decoded by eval and exported; stages find methods only through the table."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch import nn

from draftsmith import DraftsmithError, methods
from draftsmith.configs import compose
from draftsmith.eval.decoder import Draft
from draftsmith.heads.checkpoint import write_head_folder
from test_eval_run import eval_cfg, questions  # noqa: F401  (fixture)
from test_train_data import make_tiny_data

ARCH = "ThrowawayBigram"


@dataclass
class BigramConfig:
    name: str = "bigram"  # the method
    hidden: int = 16  # embedding width


class Bigram(nn.Module):
    """Next token from the current one: embed -> linear over the target vocab."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.out = nn.Linear(config.hidden, config.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))


class BigramStep(nn.Module):
    def __init__(self, drafter: Bigram):
        super().__init__()
        self.drafter = drafter

    def forward(self, input_ids, attention_mask, loss_mask, **_):
        logits = self.drafter(input_ids[:, :-1]).float()
        mask = (loss_mask[:, 1:] * attention_mask[:, 1:]).bool()
        ce = F.cross_entropy(logits[mask], input_ids[:, 1:][mask])
        n = mask.sum().float()
        return ce, torch.stack([ce.detach() * n, n])[None]  # (steps=1, stats)


class BigramProposer:
    """A greedy chain from the bigram table (q one-hot: lossless under sampling too)."""

    needs_aux = False

    def __init__(self, drafter: Bigram):
        self.drafter, self.last = drafter, None

    def reset(self, prompt_ids):
        self.last = prompt_ids[-1]

    def update(self, tokens, aux):
        self.last = tokens[-1]

    @torch.no_grad()
    def propose(self, drafting, sampling, generator=None):
        tokens, tok = [], self.last
        for _ in range(drafting.num_speculative_tokens):
            tok = int(self.drafter(torch.tensor([tok])).argmax(-1))
            tokens.append(tok)
        return Draft(tokens, list(range(-1, len(tokens) - 1)))


def new_bigram(target, cfg, train, resume):
    return Bigram(SimpleNamespace(vocab_size=target.vocab_size, hidden=cfg.hidden))


def bigram_training(drafter, target, cfg, mode, autocast):
    return BigramStep(drafter), lambda batch: {k: v for k, v in batch.items() if k not in ("aux", "last")}


def summarize(stats):
    s = stats.double()
    return {"loss_0": (s[0, 0] / s[0, 1].clamp(min=1)).item()}


def save_bigram(drafter, folder, identity, stage="train"):
    tensors = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    config = {"architectures": [ARCH], "vocab_size": drafter.config.vocab_size, "hidden": drafter.config.hidden}
    return write_head_folder(Path(folder), tensors, config, drafter.config.vocab_size, identity, stage, "bigram")


def load_bigram(folder, target=None):
    config = json.loads((Path(folder) / "config.json").read_text())
    drafter = Bigram(SimpleNamespace(vocab_size=config["vocab_size"], hidden=config["hidden"]))
    drafter.load_state_dict(load_file(str(Path(folder) / "model.safetensors")))
    return drafter.eval()


def export_bigram(drafter, folder, manifest_target, options):
    return save_bigram(drafter, folder, manifest_target, stage="export")


@pytest.fixture
def bigram_method():
    entry = methods.Method(name="bigram", config=BigramConfig, architectures=(ARCH,), new_drafter=new_bigram,
                           training=bigram_training, summarize=summarize, save=save_bigram, load=load_bigram,
                           proposer=lambda drafter, vocab, max_len: BigramProposer(drafter),
                           formats={"bigram_bin": export_bigram})
    methods.register(entry)
    yield entry
    del methods.methods()["bigram"]


def test_a_throwaway_method_trains_decodes_and_exports(bigram_method, tiny_target, questions, tmp_path, one_thread):
    from draftsmith.eval.run import run as eval_run
    from draftsmith.heads.export import ExportConfig, run as export_run
    from draftsmith.train.run import run as train_run

    data = make_tiny_data(tmp_path / "data", tiny_target, n=8)
    cfg = compose("train", ["target=tiny", f"data={data}", f"out={tmp_path / 'run'}", "max_steps=2",
                            "deepspeed=none", "wandb.mode=disabled", "progress=false", "micro_batch_size=2"])
    cfg.method = OmegaConf.structured(BigramConfig(hidden=8))  # what method=bigram would compose
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
    from draftsmith.heads.export import ExportConfig, run as export_run

    folder = tmp_path / "bigram"
    save_bigram(Bigram(SimpleNamespace(vocab_size=32, hidden=4)), folder, None)
    with pytest.raises(DraftsmithError, match="format=speculators is not a format of bigram heads"):
        export_run(ExportConfig(head=str(folder), format="speculators", out=str(tmp_path / "o")))


def test_stages_do_not_name_methods():
    """No stage run branches on a method name or architecture: they look methods up in the table."""
    root = Path(__file__).resolve().parents[1]
    for stage in ("train/run.py", "eval/run.py", "heads/export.py", "train/trainer.py"):
        text = (root / stage).read_text()
        for word in ("Eagle3", "EAGLE3", '"eagle3"', "'eagle3'"):  # classes, architectures, names as values
            assert word not in text, f"{stage} names {word}"
