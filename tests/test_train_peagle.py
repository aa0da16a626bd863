"""P-EAGLE training: the batched parallel forward equals every group run on its own, the depth-sampling rules,
the loss against a per-group reference, and the step through the method table's entry points."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import causal_mask, check_resume_is_exact, tiny_train_cfg, tiny_training_rows

from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.heads.peagle import PEagleHead, peagle_config_from_target
from draftsmith.heads.vocab import build_vocab_map
from draftsmith.train.peagle import PEagleConfig, Slots, peagle_loss, parallel_forward, sample_slots

DEPTHS = 5


@pytest.fixture(scope="module")
def setup():
    """A float64 tiny target, a 3-layer drafter, two rows (the second right-padded, loss mask with holes)."""
    torch.manual_seed(0)
    target = load_target(TargetConfig(name="tiny", dtype="float64"))
    head = PEagleHead(peagle_config_from_target(target.model.config, 200, num_layers=3,
                                                mask_token_id=target.vocab_size - 1)).double()
    d2t, t2d = build_vocab_map(torch.randint(0, 100, (target.vocab_size,)), 200)
    head.init_from_target(target.model, d2t, t2d)
    return (target, head, *tiny_training_rows(target, head))


def group_logits(head, input_ids, aux, b, t, n):
    """Reference: anchor t of row b run on its own, as the drafter runs at inference: depth-0 slots for
    positions 0..t (token x_{s+1}, 0 past the end; fc(f_s)), then n-1 mask slots at positions t+1..t+n-1, causal."""
    ids = torch.cat([F.pad(input_ids[b, 1:], (0, 1))[:t + 1], torch.full((n - 1,), head.mask_token_id)])[None]
    hidden = torch.cat([head.fuse(aux[b:b + 1, :t + 1]), head.mask_fused()[None, None].expand(1, n - 1, -1)], 1)
    pos = torch.arange(t + n)[None]
    _, logits = head(ids, hidden, pos, causal_mask(t + n))
    return logits[0, t:]  # (n, Vd): depth 0 .. n-1


def groups(slots: Slots, b: int) -> dict[int, int]:
    """anchor -> number of depths sampled for it in row b."""
    out: dict[int, int] = {}
    for a, d, r in zip(slots.anchor[b].tolist(), slots.depth[b].tolist(), slots.real[b].tolist()):
        if r:
            out[a] = max(out.get(a, 0), d + 1)
    return out


def test_batched_parallel_forward_equals_each_group_on_its_own(setup, one_thread):
    _, head, input_ids, attention_mask, loss_mask, aux, _ = setup
    valid = loss_mask.bool() & attention_mask.bool()
    slots = sample_slots(valid, DEPTHS, 0.7, 0.2, generator=torch.Generator().manual_seed(1))
    assert (slots.depth.max() >= 3).item()  # deep groups are exercised
    with torch.no_grad():
        logits = head.logits(parallel_forward(head, input_ids, attention_mask, aux, slots))  # (B, N, Vd)
        checked = 0
        for b in range(2):
            real_len = int(attention_mask[b].sum())
            index = {(a, d): n for n, (a, d, r) in enumerate(zip(slots.anchor[b].tolist(), slots.depth[b].tolist(),
                                                                 slots.real[b].tolist())) if r}
            for t, n in groups(slots, b).items():
                if t >= real_len:
                    continue  # depth-0 slots of padding positions: never scored
                ref = group_logits(head, input_ids, aux, b, t, n)
                for d in range(n):
                    torch.testing.assert_close(logits[b, index[(t, d)]], ref[d], rtol=1e-10, atol=1e-10)
                    checked += 1
    assert checked > 2 * input_ids.shape[1]


def test_depth_sampling_rules():
    T, depths, r, r_min = 40, 8, 0.7, 0.2
    valid = torch.ones(3, T, dtype=torch.bool)
    valid[1, :5] = False
    valid[2, 20] = False
    slots = sample_slots(valid, depths, r, r_min, generator=torch.Generator().manual_seed(0))
    for b in range(3):
        anchor, depth = slots.anchor[b][slots.real[b]], slots.depth[b][slots.real[b]]
        assert torch.equal(anchor[depth == 0], torch.arange(T))  # every position at depth 0
        previous = set(range(T))
        for d in range(1, depths):
            at_d = anchor[depth == d].tolist()
            n_valid = sum(1 for t in range(T) if t + 1 + d < T and valid[b, t + 1 + d])
            assert len(at_d) == min(math.floor(max(r ** d, r_min) * n_valid), len(at_d) or 10**9)
            assert len(at_d) <= math.floor(max(r ** d, r_min) * n_valid)
            assert set(at_d) <= previous  # nested: a group is depths 0..D of one anchor
            assert all(t + 1 + d < T and valid[b, t + 1 + d] for t in at_d)  # only valid targets
            assert at_d == sorted(at_d)
            previous = set(at_d)
    # full valid rows keep exactly floor(ratio * n_d) while there are enough candidates
    d0 = slots.depth[0][slots.real[0]]
    assert int((d0 == 1).sum()) == math.floor(0.7 * (T - 2))
    assert int((d0 == 2).sum()) == math.floor(0.49 * (T - 3))


def test_loss_equals_the_per_group_reference(setup, one_thread):
    _, head, input_ids, attention_mask, loss_mask, aux, tgt = setup
    valid = loss_mask.bool() & attention_mask.bool()
    slots = sample_slots(valid, DEPTHS, 0.7, 0.2, generator=torch.Generator().manual_seed(2))
    decay = 0.9
    loss, stats = peagle_loss(head, input_ids, attention_mask, loss_mask, aux, tgt, slots, DEPTHS, decay)
    T = input_ids.shape[1]
    total, count = 0.0, 0
    per_depth = torch.zeros(DEPTHS, 5, dtype=torch.float64)
    with torch.no_grad():
        for b in range(2):
            for t, n in groups(slots, b).items():
                if t >= int(attention_mask[b].sum()):
                    continue
                ref = group_logits(head, input_ids, aux, b, t, n)
                for d in range(n):
                    k = t + 1 + d
                    if k >= T or not valid[b, k]:
                        continue
                    p = tgt.probs[b, k]
                    ce = -(p * ref[d].float().log_softmax(-1)).sum().item()
                    q = ref[d].float().softmax(-1)
                    in_loss = bool(tgt.argmax_in_draft[b, k])
                    total += decay ** d * ce * in_loss
                    count += in_loss
                    per_depth[d] += torch.tensor([ce * in_loss, in_loss,
                                                  float(head.draft_to_target(ref[d].argmax()) == tgt.argmax[b, k]),
                                                  torch.minimum(q, p * tgt.in_mass[b, k]).sum().item(), 1.0])
    assert loss.item() == pytest.approx(total / count, rel=1e-6)
    torch.testing.assert_close(stats[:, :5].double(), per_depth, rtol=1e-6, atol=1e-6)
    # the outside-draft column counts the scored slots whose target argmax the draft vocab lacks
    torch.testing.assert_close(stats[:, 5].double(), per_depth[:, 4] - per_depth[:, 1], rtol=1e-6, atol=1e-6)


def test_gradients_reach_mask_hidden_and_embeddings_unless_frozen(setup):
    target, head, input_ids, attention_mask, loss_mask, aux, tgt = setup
    valid = loss_mask.bool() & attention_mask.bool()
    slots = sample_slots(valid, DEPTHS, 0.7, 0.2, generator=torch.Generator().manual_seed(3))
    head.zero_grad()
    loss, _ = peagle_loss(head, input_ids, attention_mask, loss_mask, aux, tgt, slots, DEPTHS)
    loss.backward()
    assert head.mask_hidden.grad.abs().sum() > 0 and head.embed_tokens.weight.grad is not None
    assert head.layers[2].mlp.down_proj.weight.grad.abs().sum() > 0
    head.zero_grad()
    frozen = PEagleHead(peagle_config_from_target(target.model.config, 200, 2, 0, train_embeddings=False))
    assert not frozen.embed_tokens.weight.requires_grad
    rebuilt = type(frozen)(frozen.config)  # the trainer rebuilds drafters from their config
    assert not rebuilt.embed_tokens.weight.requires_grad and len(rebuilt.layers) == 2
    # nothing scored -> zero loss, no NaN
    zero, stats = peagle_loss(head, input_ids, attention_mask, torch.zeros_like(loss_mask), aux, tgt, slots, DEPTHS)
    assert zero.item() == 0.0 and stats.sum() == 0


def test_config_defaults_are_speculators_and_refusals():
    from draftsmith.core import DraftsmithError

    cfg = PEagleConfig()
    assert (cfg.depths, cfg.down_sample_ratio, cfg.down_sample_ratio_min, cfg.num_layers) == (8, 0.7, 0.2, 4)
    assert cfg.depth_decay == 1.0 and cfg.train_embeddings
    with pytest.raises(DraftsmithError, match="method.down_sample_ratio=1.5"):
        PEagleConfig(down_sample_ratio=1.5)
    with pytest.raises(DraftsmithError, match="method.num_layers=0"):
        PEagleConfig(num_layers=0)


# ---- `draftsmith train method=peagle`: the same trainer, online and offline, exact resume ----------------

def _train_cfg(data, out, deepspeed="none", mode="auto", **kw):
    method = PEagleConfig(draft_vocab_size=128, num_layers=2, depths=4)
    return tiny_train_cfg(data, out, method, deepspeed, mode, **kw)


def _resume_is_exact(tiny_data, tmp_path, deepspeed):
    full, resumed, head = check_resume_is_exact(_train_cfg, tiny_data, tmp_path, deepspeed, method="peagle",
                                                depths=4, own_tensor="mask_hidden", layers=2)
    assert resumed["metrics"]["loss"] == pytest.approx(full["metrics"]["loss"], abs=1e-6)
    # embeddings were trained (the default): they moved away from the target's
    tiny = load_target(TargetConfig(name="tiny", dtype="float32"))
    assert not torch.equal(head.embed_tokens.weight, tiny.model.get_input_embeddings().weight)


def test_train_offline_resume_is_exact(tiny_data, tmp_path, one_thread):
    _resume_is_exact(tiny_data, tmp_path, "none")


def test_train_offline_resume_is_exact_under_zero2(tiny_data, tmp_path, one_thread):
    _resume_is_exact(tiny_data, tmp_path, "zero2")


def test_train_online_with_frozen_embeddings(tiny_data, tmp_path, one_thread):
    from draftsmith.train.run import run

    cfg = _train_cfg(tiny_data, tmp_path / "on", mode="online", max_steps=2)
    cfg.method.train_embeddings = False
    result = run(cfg)
    assert result["mode"] == "online" and result["steps"] == 2
    tiny = load_target(TargetConfig(name="tiny", dtype="float32"))
    from draftsmith.heads.peagle_folders import load_peagle

    head = load_peagle(tmp_path / "on" / "final")
    assert torch.equal(head.embed_tokens.weight, tiny.model.get_input_embeddings().weight)


def test_the_method_composes_from_the_cli(compose_cfg):
    cfg = compose_cfg("train", "method=peagle", "method.depths=5", "method.num_layers=2", "data=d", "out=o")
    assert cfg.method.name == "peagle" and cfg.method.depths == 5 and cfg.method.down_sample_ratio == 0.7
