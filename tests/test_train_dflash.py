"""DFlash training: the batched block forward equals every block run on its own as at inference (in float64; two
deliberately broken masks fail it), the anchor rules, the loss and both position weightings against a per-block
reference, and the step through the method table's entry points (online, offline, exact resume)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import check_resume_is_exact, randomize_weights, tiny_train_cfg, tiny_training_rows

from draftsmith.core import DraftsmithError
from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.heads.dflash import DFlashHead, block_mask, dflash_config_from_target
from draftsmith.heads.vocab import build_vocab_map
from draftsmith.train.block import sample_anchors
from draftsmith.train.dflash import DFlashConfig, block_forward, dflash_loss, summarize

BLOCK = 4


@pytest.fixture(scope="module")
def setup():
    """A float64 tiny target, a 3-layer drafter (random weights), two rows (the second right-padded, loss mask
    with holes)."""
    torch.manual_seed(0)
    target = load_target(TargetConfig(name="tiny", dtype="float64"))
    head = DFlashHead(dflash_config_from_target(target.model.config, 200, 3, BLOCK, target.vocab_size - 1,
                                                target.aux_layer_ids)).double()
    d2t, t2d = build_vocab_map(torch.randint(0, 100, (target.vocab_size,)), 200)
    head.init_from_target(target.model, d2t, t2d)
    randomize_weights(head, ("fc", "layers", "hidden_norm"))
    return (target, head, *tiny_training_rows(target, head))


def block_reference(head, input_ids, aux, b, a):
    """Anchor a of row b run on its own, as the drafter runs at inference: context f_0 .. f_{a-1}, the block
    [x_a, mask x (bs-1)] at positions a .. a+bs-1, every query seeing every key."""
    bs = head.block_size
    ids = torch.tensor([[int(input_ids[b, a])] + [head.mask_token_id] * (bs - 1)])
    mask = torch.ones(1, 1, bs, a + bs, dtype=torch.bool)
    _, logits = head(ids, torch.arange(a, a + bs)[None], head.context(aux[b:b + 1, :a]), torch.arange(a)[None], mask)
    return logits[0]  # (bs, Vd)


def batched_logits(head, input_ids, aux, anchor, mask):
    B = input_ids.shape[0]
    return head.logits(block_forward(head, input_ids, aux, anchor, mask)).view(B, anchor.shape[1], head.block_size, -1)


ANCHORS = torch.tensor([[1, 4, 5, 9, 12], [2, 3, 7, 8, 0]])  # row 1's last block is padding
REAL = torch.tensor([[True] * 5, [True] * 4 + [False]])


def max_difference(setup, mask) -> float:
    _, head, input_ids, attention_mask, _, aux, _ = setup
    with torch.no_grad():
        got = batched_logits(head, input_ids, aux, ANCHORS, mask)
        worst = 0.0
        for b in range(2):
            for j in range(5):
                if REAL[b, j]:
                    ref = block_reference(head, input_ids, aux, b, int(ANCHORS[b, j]))
                    worst = max(worst, float((got[b, j] - ref).abs().max()))
    return worst


def test_batched_block_forward_equals_each_block_on_its_own(setup, one_thread):
    _, head, _, attention_mask, *_ = setup
    assert max_difference(setup, block_mask(ANCHORS, BLOCK, attention_mask)) < 1e-10


@pytest.mark.parametrize("broken", ["sees_its_anchor_as_context", "causal_inside_the_block"])
def test_a_broken_mask_fails_the_parity(setup, one_thread, broken):
    """The negative controls: a block that also reads the context at its anchor's position (one step of the
    future), or a causal block (vLLM runs it non-causally): each must break the equality."""
    _, head, _, attention_mask, *_ = setup
    T = attention_mask.shape[1]
    mask = block_mask(ANCHORS, BLOCK, attention_mask).clone()
    q_anchor = ANCHORS.repeat_interleave(BLOCK, dim=1)  # (B, N)
    if broken == "sees_its_anchor_as_context":
        mask[:, 0, :, :T] |= (torch.arange(T)[None, None] == q_anchor[:, :, None]) & attention_mask.bool()[:, None]
    else:
        N = q_anchor.shape[1]
        mask[:, 0, :, T:] &= torch.ones(N, N, dtype=torch.bool).tril()
    assert max_difference(setup, mask) > 1e-3


def test_anchor_rules(setup):
    _, _, _, attention_mask, loss_mask, *_ = setup
    valid = loss_mask.bool() & attention_mask.bool()
    anchor, real = sample_anchors(valid, 64, generator=torch.Generator().manual_seed(0))
    for b in range(2):
        got = anchor[b][real[b]].tolist()
        assert got == sorted(got) and got == [t for t in range(1, 14) if valid[b, t]]  # every candidate, sorted
    anchor, real = sample_anchors(valid, 3, generator=torch.Generator().manual_seed(0))
    assert anchor.shape == (2, 3) and real.all()
    assert all(valid[b, a] and a >= 1 for b in range(2) for a in anchor[b].tolist())


def per_slot_reference(setup, anchor, real):
    """(b, a, k, CE, in_loss, correct) of every counted slot, each block run on its own."""
    _, head, input_ids, attention_mask, loss_mask, aux, tgt = setup
    T = input_ids.shape[1]
    valid = loss_mask.bool() & attention_mask.bool()
    rows = []
    torch.set_grad_enabled(False)
    for b in range(2):
        for j in range(anchor.shape[1]):
            if not real[b, j]:
                continue
            a = int(anchor[b, j])
            logits = block_reference(head, input_ids, aux, b, a)
            for k in range(1, BLOCK):
                u = a + k - 1
                if u <= T - 1 and valid[b, u]:
                    ce = float(-(tgt.probs[b, u] * logits[k].log_softmax(-1)).sum())
                    correct = int(head.draft_to_target(logits[k].argmax())) == int(tgt.argmax[b, u])
                    rows.append((b, a, k, ce, bool(tgt.argmax_in_draft[b, u]), correct))
    torch.set_grad_enabled(True)
    return rows


@pytest.mark.parametrize("weighting", ["exp_decay", "dpace"])
def test_loss_and_statistics_equal_the_per_block_reference(setup, one_thread, weighting):
    _, head, input_ids, attention_mask, loss_mask, aux, tgt = setup
    cfg = DFlashConfig(block_size=BLOCK, loss_weighting=weighting, gamma=2.0, dpace_alpha=0.3)
    with torch.no_grad():
        loss, stats = dflash_loss(head, input_ids, attention_mask, loss_mask, aux, tgt, ANCHORS, REAL, cfg)
    rows = per_slot_reference(setup, ANCHORS, REAL)
    assert stats.shape == (BLOCK - 1, 9) and stats[:, 4].sum() == len(rows)
    n = sum(r[4] for r in rows)
    if weighting == "exp_decay":
        expected = sum(math.exp(-(k - 1) / 2.0) * ce for _, _, k, ce, ok, _ in rows if ok) / n
    else:  # D-PACE written out per block: w_k = sum_{j >= k, counted} prod_{i <= j, counted} s_i
        expected = 0.0
        for b, a in {(r[0], r[1]) for r in rows}:
            block = {k: (ce, ok) for bb, aa, k, ce, ok, _ in rows if (bb, aa) == (b, a) and ok}
            s = {k: (1 - 0.3) * math.exp(-ce) + 0.3 for k, (ce, _) in block.items()}
            prefix = {j: math.prod(s[i] for i in block if i <= j) for j in block}
            expected += sum(sum(prefix[j] for j in block if j >= k) * block[k][0] for k in block)
        expected /= n
    assert float(loss) == pytest.approx(expected, rel=1e-6)  # the loss runs in float32 (as every method's)
    for k in range(1, BLOCK):
        here = [r for r in rows if r[2] == k]
        assert stats[k - 1, 4] == len(here) and stats[k - 1, 2] == sum(r[5] for r in here)
    metrics = summarize(stats)
    assert 1.0 <= metrics["etau_greedy"] <= BLOCK and set(metrics) >= {"loss_0", "acc_2", "alpha_1"}


def test_gradients_reach_the_layers_not_the_embeddings(setup):
    _, head, input_ids, attention_mask, loss_mask, aux, tgt = setup
    head.zero_grad()
    loss, _ = dflash_loss(head, input_ids, attention_mask, loss_mask, aux, tgt, ANCHORS, REAL, DFlashConfig(block_size=BLOCK))
    loss.backward()
    assert head.fc.weight.grad.abs().sum() > 0 and head.hidden_norm.weight.grad.abs().sum() > 0
    assert head.layers[2].self_attn.k_norm.weight.grad.abs().sum() > 0  # the context keys reach every layer
    assert head.embed_tokens.weight.grad is None  # a frozen copy of the target's
    head.zero_grad()


def test_config_refusals():
    assert DFlashConfig().block_size == 8 and DFlashConfig().gamma == 4.0 and DFlashConfig().dpace_alpha == 0.5
    with pytest.raises(DraftsmithError, match="method.block_size"):
        DFlashConfig(block_size=1)
    with pytest.raises(DraftsmithError, match="method.loss_weighting"):
        DFlashConfig(loss_weighting="kl")


# ---- `draftsmith train method=dflash`: the same trainer, online and offline, exact resume ----------------

def _train_cfg(data, out, deepspeed="none", mode="auto", **kw):
    method = DFlashConfig(draft_vocab_size=128, num_layers=2, block_size=BLOCK, max_anchors=8)
    return tiny_train_cfg(data, out, method, deepspeed, mode, **kw)


def _resume_is_exact(tiny_data, tmp_path, deepspeed):
    _, _, head = check_resume_is_exact(_train_cfg, tiny_data, tmp_path, deepspeed, method="dflash", depths=BLOCK - 1,
                                       own_tensor="hidden_norm.weight", layers=2)
    tiny = load_target(TargetConfig(name="tiny", dtype="float32"))
    assert torch.equal(head.embed_tokens.weight, tiny.model.get_input_embeddings().weight)  # frozen


def test_train_offline_resume_is_exact(tiny_data, tmp_path, one_thread):
    _resume_is_exact(tiny_data, tmp_path, "none")


def test_train_offline_resume_is_exact_under_zero2(tiny_data, tmp_path, one_thread):
    _resume_is_exact(tiny_data, tmp_path, "zero2")


def test_train_online_and_best_by_held_out_etau(tiny_data, tmp_path, one_thread):
    from draftsmith.train.run import run

    result = run(_train_cfg(tiny_data, tmp_path / "on", mode="online", max_steps=2, eval_every=1, val_samples=2))
    assert result["mode"] == "online" and result["steps"] == 2
    assert result["best"]["metric"] == "val_etau_greedy" and (tmp_path / "on" / "best" / "config.json").is_file()


def test_the_method_composes_from_the_cli(compose_cfg):
    cfg = compose_cfg("train", "method=dflash", "method.block_size=6", "method.loss_weighting=dpace", "data=d", "out=o")
    assert cfg.method.name == "dflash" and cfg.method.block_size == 6 and cfg.method.num_layers == 4
