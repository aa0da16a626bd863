"""EAGLE-3's recipe options (issue 23), each off by default: the EAGLE-3.1 norms (norm_before_fc, fc_norm,
norm_output) in the head, its folders and the loader, as vLLM 0.32.0's llama_eagle3.py reads them; the training-only
feature noise; optimizer=muon. The TTT unroll vs the decoder, lossless decoding, the speculators outside check and
exact resume with them on are in the tests they extend (test_decoder_eagle3, test_decoder_greedy,
test_heads_speculators, test_train_resume)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from helpers import logits_of, random_head, random_inputs

from draftsmith.core import DraftsmithError
from draftsmith.heads.eagle3_folders import load_eagle3, save_eagle3, save_speculators
from draftsmith.heads.eagle3_folders import speculators_name
from draftsmith.train import checkpoint as ckpt
from draftsmith.train.eagle3 import Eagle3Config, Eagle3Step, add_feature_noise
from draftsmith.train.features import TargetHead
from draftsmith.train.optimizers import MuonWithAdamW, build_optimizer, split_for_muon
from draftsmith.train.trainer import resolve_deepspeed

ALL = {"norm_before_fc": True, "fc_norm": True, "norm_output": True}
NORM_SETS = [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_output": True}, ALL]
NORM_IDS = ["norm_before_fc", "fc_norm", "norm_output", "all"]


def tensors_of(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


# --------------------------------------------------------------------------- the head and its folders

@pytest.mark.parametrize("norms", NORM_SETS, ids=NORM_IDS)
def test_norm_tensors_config_keys_and_round_trip(tiny_target, tmp_path, norms):
    """The tensors vLLM loads (input_norm.weight [3H_t], fc_norm.{i}.weight [H_t]), the config keys it reads
    (true, top level), and draftsmith's loader rebuilds the same head: identical logits."""
    head = random_head(tiny_target, **norms)
    H = tiny_target.hidden_size
    folder = save_eagle3(head, tmp_path / "h", manifest_target=tiny_target.identity())
    tensors, config = tensors_of(folder), json.loads((folder / "config.json").read_text())
    want = ({"input_norm.weight": (3 * H,)} if norms.get("norm_before_fc") else {}) | (
        {f"fc_norm.{i}.weight": (H,) for i in range(3)} if norms.get("fc_norm") else {})
    assert {n: tuple(t.shape) for n, t in tensors.items() if n.startswith(("input_norm", "fc_norm"))} == want
    for name in ("norm_before_fc", "fc_norm", "norm_output"):
        assert config.get(name, False) is norms.get(name, False)  # written only when on (vLLM's default: false)
    loaded = load_eagle3(folder)
    assert {n: getattr(loaded.config, n) for n in ALL} == {n: norms.get(n, False) for n in ALL}
    inputs = random_inputs(head)
    assert torch.equal(logits_of(loaded, *inputs), logits_of(head, *inputs))
    ids, aux, pos = inputs  # the hidden each step hands on, too (norm_output: post-norm)
    mask = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    assert torch.equal(loaded(ids, loaded.fuse(aux), pos, mask)[0], head(ids, head.fuse(aux), pos, mask)[0])


def test_each_norm_does_what_vllm_does(tiny_target):
    """fuse = fc(fc_norm_i(input_norm(aux))_i) (vLLM's combine_hidden_states order); norm_output hands on norm(h')."""
    head = random_head(tiny_target, **ALL)
    ids, aux, pos = random_inputs(head)
    with torch.no_grad():
        x = head.input_norm(aux)
        x = torch.cat([n(c) for n, c in zip(head.fc_norm, x.chunk(3, dim=-1))], dim=-1)
        torch.testing.assert_close(head.fuse(aux), head.fc(x), rtol=0, atol=0)
        mask = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
        hidden, logits = head(ids, head.fuse(aux), pos, mask)
        head.norm_output = False
        pre, same = head(ids, head.fuse(aux), pos, mask)
    assert torch.equal(logits, same) and torch.equal(hidden, head.norm(pre)) and not torch.equal(hidden, pre)


def test_without_norms_the_head_is_as_before(tiny_target):
    head = random_head(tiny_target)
    assert head.input_norm is None and head.fc_norm is None and not head.norm_output
    assert not any(n.startswith(("input_norm", "fc_norm")) for n in head.state_dict())


def test_norm_before_fc_is_read_from_eagle_config_first(tiny_target, tmp_path):
    """vLLM: eagle_config.get("norm_before_fc", config.norm_before_fc): a folder whose eagle_config says false has no
    input_norm (and then refuses its tensor), one whose eagle_config says true needs it."""
    folder = save_eagle3(random_head(tiny_target, norm_before_fc=True), tmp_path / "h")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eagle_config": {"norm_before_fc": False}}))
    with pytest.raises(DraftsmithError, match="unexpected tensor 'input_norm.weight'"):
        load_eagle3(folder)
    del config["norm_before_fc"]
    (folder / "config.json").write_text(json.dumps({**config, "eagle_config": {"norm_before_fc": True}}))
    assert load_eagle3(folder).input_norm is not None


def test_speculators_export_carries_the_norms_and_refuses_both_input_norms(tiny_target, tmp_path):
    head = random_head(tiny_target, norm_before_fc=True, norm_output=True)
    folder = save_speculators(head, tmp_path / "s", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert (config["norm_before_fc"], config["fc_norm"], config["norm_output"]) == (True, False, True)
    tensors = tensors_of(folder)
    assert set(tensors) == {speculators_name(n) for n in head.state_dict()}
    assert torch.equal(tensors["input_norm.weight"], head.input_norm.weight)
    folder = save_speculators(random_head(tiny_target, fc_norm=True), tmp_path / "f", dtype=torch.float32)
    assert json.loads((folder / "config.json").read_text())["fc_norm"] is True
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(tensors_of(folder))
    with pytest.raises(DraftsmithError, match="cannot hold this head: it has both norm_before_fc and fc_norm"):
        save_speculators(random_head(tiny_target, norm_before_fc=True, fc_norm=True), tmp_path / "both")
    assert not (tmp_path / "both").exists()


def test_training_builds_the_configured_norms(tiny_target):
    import types

    from draftsmith.train.eagle3 import new_eagle3

    rows = types.SimpleNamespace(indices=[0], input_ids=[[1, 2, 3, 4]], loss_mask=[[0, 1, 1, 1]])
    head = new_eagle3(tiny_target, Eagle3Config(draft_vocab_size=64, fc_norm=True, norm_output=True), rows, None)
    assert head.input_norm is None and len(head.fc_norm) == 3 and head.norm_output


# --------------------------------------------------------------------------- feature noise

def _step_inputs(tiny_target, head, T=9, B=2):
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, tiny_target.vocab_size, (B, T), generator=g)
    attention_mask = torch.ones(B, T, dtype=torch.long)
    aux, last = tiny_target.features(input_ids, attention_mask)
    target = TargetHead(tiny_target.model.lm_head.weight, head.t2d)(last)
    return dict(input_ids=input_ids, attention_mask=attention_mask, loss_mask=torch.ones_like(input_ids), aux=aux,
                target=target)


def test_feature_noise_is_uniform_absolute_and_seeded():
    aux = torch.full((4, 50, 30), 7.0)
    torch.manual_seed(11)
    a = add_feature_noise(aux, 0.05)
    torch.manual_seed(11)
    b = add_feature_noise(aux, 0.05)
    d = a - aux
    assert torch.equal(a, b) and d.abs().max() <= 0.05 and d.min() < -0.04 and d.max() > 0.04
    assert abs(d.mean().item()) < 2e-3 and d.std().item() == pytest.approx(0.05 / 3 ** 0.5, rel=0.05)
    assert not torch.equal(add_feature_noise(aux, 0.05), a)  # the CPU generator moved on: the next batch differs
    # absolute, not relative to the features' size
    assert (add_feature_noise(aux * 1000, 0.05) - aux * 1000).abs().max() <= 0.05 * (1 + 1e-3)


def test_feature_noise_changes_the_training_loss_only(tiny_target):
    head = random_head(tiny_target)
    batch = _step_inputs(tiny_target, head)
    clean = Eagle3Step(head, 3, 0.8)
    noisy = Eagle3Step(head, 3, 0.8, feature_noise=0.5)
    state = torch.get_rng_state()
    loss0, _ = clean(**batch)
    assert torch.equal(torch.get_rng_state(), state)  # off: nothing drawn
    loss1, _ = noisy(**batch)
    assert loss1.item() != loss0.item()
    noisy.eval()  # the held-out evaluation (train/trainer.py evaluate) and anything else in eval mode: no noise
    state = torch.get_rng_state()
    loss2, _ = noisy(**batch)
    assert loss2.item() == loss0.item() and torch.equal(torch.get_rng_state(), state)


# --------------------------------------------------------------------------- Muon

def test_muon_takes_the_weight_matrices_as_speculators_splits_them(tiny_target):
    step = Eagle3Step(random_head(tiny_target, **ALL), 3, 0.8)
    muon, adamw = split_for_muon(step)
    names = {id(p): n for n, p in step.named_parameters()}
    assert sorted(names[id(p)] for p in muon) == sorted(
        ["drafter.fc.weight"] + [f"drafter.midlayer.self_attn.{x}_proj.weight" for x in "qkvo"]
        + [f"drafter.midlayer.mlp.{x}_proj.weight" for x in ("gate", "up", "down")])
    assert sorted(names[id(p)] for p in adamw) == sorted(
        ["drafter.lm_head.weight", "drafter.norm.weight", "drafter.input_norm.weight"]
        + [f"drafter.fc_norm.{i}.weight" for i in range(3)]
        + [f"drafter.midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")])
    # the frozen embeddings are in neither


class _Options:
    optimizer, lr, betas, weight_decay = "muon", 1e-3, (0.9, 0.95), 0.0
    muon_lr, muon_momentum, muon_weight_decay = None, 0.95, 0.1


def test_muon_state_round_trips_through_the_checkpoint_files(tiny_target, tmp_path):
    """Two optimizer steps == one, saved (safetensors + JSON) and loaded into a fresh optimizer, then one more."""
    head = random_head(tiny_target)
    batch = _step_inputs(tiny_target, head)

    def run(step, opt, sched):
        loss, _ = step(**batch)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    def build():
        step = Eagle3Step(random_head(tiny_target), 3, 0.8)
        opt = build_optimizer(step, _Options)
        return step, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1))

    a, opt_a, sched_a = build()
    assert isinstance(opt_a, MuonWithAdamW) and [type(p).__name__ for p in opt_a.parts] == ["Muon", "AdamW"]
    assert opt_a.param_groups[0]["lr"] == _Options.lr and opt_a.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    run(a, opt_a, sched_a)
    ckpt.save_optimizer(opt_a, tmp_path)
    scheduler_state = sched_a.state_dict()
    b, opt_b, sched_b = build()
    b.load_state_dict(a.state_dict())
    ckpt.load_optimizer(opt_b, tmp_path)
    sched_b.load_state_dict(scheduler_state)
    assert opt_b.parts[0].state is opt_b.state and opt_b.parts[0].param_groups[0] is opt_b.param_groups[0]
    run(a, opt_a, sched_a)
    run(b, opt_b, sched_b)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"] == _Options.lr / 3  # the schedule reached Muon
    assert not torch.equal(a.drafter.fc.weight, random_head(tiny_target).fc.weight)  # and Muon moved the matrices


def test_auto_deepspeed_is_plain_torch_with_muon():
    assert resolve_deepspeed("auto", {"WORLD_SIZE": "4"}, optimizer="muon")[0] == "none"
    assert resolve_deepspeed("auto", {"WORLD_SIZE": "4"})[0] == "zero2"
