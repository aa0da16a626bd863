"""method=mtp training (issue 48): the loss and its statistics against a plain per-row reference, only the MTP layer
learns (the target, its embeddings and lm_head stay as they were), the target's own layer is read from a MiMo folder
and a fresh one grafted where there is none, and `draftsmith train method=mtp` then `export format=mimo` stitch the
trained layer into a copy of the target."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import causal_mask, mtp_decoder_target, random_layers, tiny_train_cfg, two_questions
from safetensors import safe_open

from draftsmith.cli import main
from draftsmith.configs import compose
from draftsmith.core import DraftsmithError
from draftsmith.core.methods import method_for_folder, methods
from draftsmith.data_gen.target import TargetConfig, load_target, tiny_tokenizer
from draftsmith.eval import run as ev
from draftsmith.heads import mtp_folders
from draftsmith.heads.mtp import mtp_config_from_target
from draftsmith.train.features import TargetHead
from draftsmith.train.mtp import MTPConfig, mtp_loss, new_mtp

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _rows(target, T: int = 14):
    """Two rows of random tokens, the second right-padded by 4, the loss mask off on a 3-token prompt; with the
    target's hidden_states[N] and its distributions over the whole vocab."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (2, T), generator=g)
    attention = torch.ones(2, T, dtype=torch.long)
    attention[1, T - 4:] = 0
    loss_mask = torch.ones(2, T, dtype=torch.long)
    loss_mask[:, :3] = 0
    with torch.no_grad():
        last = target.model(ids, attention_mask=attention, output_hidden_states=True).hidden_states[-1]
    side = TargetHead(target.lm_head.weight, torch.ones(target.config.vocab_size, dtype=torch.bool))(last)
    return ids, attention, loss_mask, last, side


def test_loss_equals_a_per_row_reference_and_weights_steps():
    """Each counted (t, k) is scored as inference computes it: row t's chain of k+1 steps from h_t alone."""
    target = mtp_decoder_target()
    drafter = random_layers(mtp_config_from_target(target.config), seed=2).double().attach(target)
    ids, attention, loss_mask, last, side = _rows(target)
    steps, decay = 3, 0.6
    loss, stats = mtp_loss(drafter, ids, attention, loss_mask, last, side, steps, decay)
    h0 = drafter.engine_hidden(last)
    per_step = [[] for _ in range(steps)]
    valid = (loss_mask.bool() & attention.bool())
    with torch.no_grad():
        for b in range(2):
            for t in range(ids.shape[1] - 1):
                # step 0 over rows 0..t (causal), then one row per step on top of those keys, as the proposer drafts
                from draftsmith.heads.kit import ConcatKVCache
                cache = ConcatKVCache()
                out, _ = drafter(ids[b:b + 1, 1:t + 2], h0[b:b + 1, : t + 1], torch.arange(t + 1)[None],
                                 causal_mask(t + 1), cache)
                h = out[:, -1:]
                for k in range(steps):
                    if t + k + 1 >= ids.shape[1]:
                        break
                    if k > 0:
                        width = t + 1 + k
                        h, _ = drafter(ids[b:b + 1, t + k + 1: t + k + 2], h, torch.tensor([[t + k]]),
                                       torch.ones(1, 1, 1, width, dtype=torch.bool), cache)
                    if valid[b, t + k + 1]:
                        logits = drafter.logits(h[0, 0]).float()
                        per_step[k].append(F.cross_entropy(logits[None], side.probs[b, t + k + 1][None]))
    weights = [decay ** k for k in range(steps)]
    expected = sum(w / sum(weights) * torch.stack(ce).mean() for w, ce in zip(weights, per_step))
    torch.testing.assert_close(loss.double(), expected.double(), rtol=1e-5, atol=1e-6)
    assert [int(stats[k, 1]) for k in range(steps)] == [len(ce) for ce in per_step]  # loss_count per step


def test_only_the_mtp_layer_learns():
    target = mtp_decoder_target()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    drafter = random_layers(mtp_config_from_target(target.config), seed=2).double().attach(target)
    assert set(drafter.state_dict()) == {f"layers.0.{n}" for n in mtp_folders.layer_shapes(drafter.config)}
    ids, attention, loss_mask, last, side = _rows(target)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss, _ = mtp_loss(drafter, ids, attention, loss_mask, last, side, 3, 0.8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]  # soft-CE: the target's own entropy is its floor
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())  # target, embeddings, lm_head


def test_config_refusals():
    assert MTPConfig().steps == 3 and MTPConfig().step_decay == 0.8
    with pytest.raises(DraftsmithError, match="method.steps"):
        MTPConfig(steps=0)
    with pytest.raises(DraftsmithError, match="method.step_decay"):
        MTPConfig(step_decay=0)


@pytest.fixture(scope="module")
def mimo_target(tmp_path_factory):
    """The tiny preset (its tokenizer and weights) saved as a MiMo with a random MTP layer, loaded as a target."""
    folder = tmp_path_factory.mktemp("mimo") / "tiny-mimo"
    tiny = load_target(TargetConfig(name="tiny", dtype="float32"))
    drafter = random_layers(mtp_config_from_target(tiny.model.config), seed=3)
    mtp_folders.save_as_mimo(tiny.model, folder, drafter)
    tiny_tokenizer().save_pretrained(folder)
    return load_target(TargetConfig(name=str(folder), dtype="float32")), drafter


def test_new_drafter_reads_the_targets_own_layer_or_grafts_one(mimo_target):
    target, saved = mimo_target
    drafter = new_mtp(target, MTPConfig(), None, None)
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in saved.state_dict().items())
    assert all(p.requires_grad for p in drafter.parameters())
    assert not any(p.requires_grad for p in target.model.parameters())
    grafted = new_mtp(load_target(TargetConfig(name="tiny", dtype="float32")), MTPConfig(num_layers=2), None, None)
    assert len(grafted.layers) == 2 and grafted.config.target_architecture == "MiMoForCausalLM"
    assert grafted.config.mtp_hidden == "pre_norm" and grafted.config.mtp_fusion == "hidden_first"


@pytest.mark.parametrize("own_layer", [True, False])
def test_the_layer_trains_in_fp32_beside_a_bf16_target(mimo_target, own_layer):
    """Master weights in fp32 whatever the target's dtype (the demo's target is bf16 under dtype auto): in bf16 Adam's
    updates round away (a norm weight of 1 moves in steps of 2^-7). The logits come out in the lm_head's dtype."""
    folder = mimo_target[0].target_id if own_layer else "tiny"
    target = load_target(TargetConfig(name=str(folder), dtype="bfloat16"))
    drafter = new_mtp(target, MTPConfig(), None, None)
    assert {p.dtype for p in drafter.parameters()} == {torch.float32}
    assert drafter.logits(torch.randn(1, 2, target.model.config.hidden_size)).dtype == torch.bfloat16


def test_train_then_export_stitches_the_trained_layer(tiny_data, tmp_path):
    from draftsmith.train.run import run

    result = run(tiny_train_cfg(tiny_data, tmp_path / "run", MTPConfig(), mode="online", max_steps=3))
    assert result["method"] == "mtp" and result["steps"] == 3
    assert {"loss_0", "loss_2", "acc_1", "etau_greedy"} <= set(result["metrics"])
    final = tmp_path / "run" / "final"
    assert method_for_folder(final).name == "mtp"
    trained = methods()["mtp"].load(final)
    # eval reads train's output beside the target it was trained for, and stays lossless
    report = ev.run(compose("eval", ["target=tiny", "target.dtype=float32", f"head={tmp_path / 'run'}",
                                     f"prompts.path={two_questions(tmp_path)}", "prompts.n=null", "max_new_tokens=8",
                                     "repeats=1", "progress=false", "plot=false", f"out={tmp_path / 'eval'}"]))
    assert report["method"] == "mtp" and report["greedy_identical_fraction"] == 1.0
    # a target folder to stitch into: the tiny preset saved as a MiMo (its own layer untrained)
    tiny = load_target(TargetConfig(name="tiny", dtype="float32"))
    source, _ = tmp_path / "tiny-mimo", mtp_folders.save_as_mimo(tiny.model, tmp_path / "tiny-mimo")
    main(["export", f"head={final}", "format=mimo", f"target_dir={source}", "dtype=float32",
          f"out={tmp_path / 'stitched'}"])
    out = tmp_path / "stitched"
    stitched = mtp_folders.load_mtp(out)
    assert all(torch.equal(stitched.state_dict()[k], v) for k, v in trained.state_dict().items())
    with safe_open(str(source / "model.safetensors"), "pt") as a, safe_open(str(out / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        assert all(torch.equal(a.get_tensor(n), b.get_tensor(n)) for n in a.keys() if ".mtp_layers." not in n)


def test_the_method_composes_from_the_cli(compose_cfg):
    cfg = compose_cfg("train", "method=mtp", "method.step_decay=0.6", "data=d", "out=o")
    assert cfg.method.name == "mtp" and cfg.method.step_decay == 0.6 and cfg.method.steps == 3
