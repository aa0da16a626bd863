"""DSpark (method=dspark): the tensor names and shapes; the Markov bias and the confidence of a slot; DeepSpec's loss
against a hand-computed case (float64), its weights and decay, and the batched loss against each block run on its own;
the warm start from a DFlash folder (and its refusals); the folder's round trip and refusals; a short training run with
exact resume; the built-in decoder: slot-by-slot drafts equal the drafter run from scratch, greedy token-identical with
target-only, `stop_below` on the confidence, and the seeded statistical sampling test with its negative control."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import (SAMPLING_V, check_greedy_is_token_identical_to_target_only, check_resume_is_exact, eval_cfg,
                     init_from_used_tokens, peaked_llama, randomize_weights, speculative_sampling_pvalue,
                     statistical_sampling_tests, tiny_train_cfg, tiny_training_rows)
from safetensors.torch import load_file

from draftsmith.core import DraftsmithError
from draftsmith.core.methods import method_for_folder, methods
from draftsmith.core.sampling import SamplingConfig, process_logits
from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.eval.decoder import DraftingConfig, speculative_generate
from draftsmith.eval.run import run as run_eval
from draftsmith.eval.proposers.dspark import DSparkProposer
from draftsmith.eval.target_runner import TargetRunner
from draftsmith.heads.dflash import DFlashHead, dflash_config_from_target
from draftsmith.heads.dflash_folders import save_dflash
from draftsmith.heads.dspark import DSparkHead, dspark_config_from_target
from draftsmith.heads.dspark_folders import load_dspark, save_dspark
from draftsmith.heads.vocab import build_vocab_map
from draftsmith.train.dspark import DSparkConfig, dspark_loss, dspark_terms, new_dspark, summarize

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BLOCK, RANK, LAYERS = 4, 8, 2


def random_dspark(target, draft_vocab: int = 200, seed: int = 0, dtype=torch.float32) -> DSparkHead:
    """A drafter of a loaded target, every weight but the copied embeddings / lm_head random (the Markov weights large
    enough to move the logits)."""
    torch.manual_seed(seed)
    head = DSparkHead(dspark_config_from_target(target.model.config, draft_vocab, LAYERS, BLOCK, target.vocab_size - 1,
                                                target.aux_layer_ids, RANK)).to(dtype)
    head.init_from_target(target.model, *build_vocab_map(torch.randint(0, 100, (target.vocab_size,)), draft_vocab))
    return randomize_weights(head, ("fc", "layers", "hidden_norm", "norm", "markov_head", "confidence_head"))


# ---- the head ----------------------------------------------------------------------------------------------------

def test_tensor_names_and_shapes(tiny_target, tmp_path):
    head = random_dspark(tiny_target)
    H, V, Vd = head.config.hidden_size, head.config.vocab_size, head.config.draft_vocab_size
    shapes = {n: tuple(p.shape) for n, p in head.named_parameters()}
    assert shapes["markov_head.markov_w1.weight"] == (V, RANK) and shapes["markov_head.markov_w2.weight"] == (Vd, RANK)
    assert shapes["confidence_head.proj.weight"] == (1, H + RANK) and shapes["confidence_head.proj.bias"] == (1,)
    assert "markov_head.markov_w2.bias" not in shapes
    saved = load_file(str(save_dspark(head, tmp_path / "d") / "model.safetensors"))
    assert {n: tuple(t.shape) for n, t in saved.items() if n.startswith(("markov", "confidence"))} == {
        n: s for n, s in shapes.items() if n.startswith(("markov", "confidence"))}
    assert "fc.weight" in saved and "layers.1.self_attn.k_norm.weight" in saved and "d2t" in saved


def test_markov_bias_and_confidence_of_a_slot(tiny_target):
    head = random_dspark(tiny_target).double()
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, head.config.hidden_size, generator=g, dtype=torch.float64)
    prev = torch.tensor([5, 7, 5])
    logits, conf = head.slot_outputs(h, prev)
    x = head.norm(h)
    w1, w2 = head.markov_head.markov_w1.weight, head.markov_head.markov_w2.weight
    torch.testing.assert_close(logits, x @ head.lm_head.weight.T + w1[prev] @ w2.T, rtol=1e-12, atol=1e-12)
    proj = head.confidence_head.proj
    torch.testing.assert_close(conf, torch.cat([x, w1[prev]], -1) @ proj.weight[0] + proj.bias, rtol=1e-12, atol=1e-12)
    assert (logits[0] - head.logits(h[0])).abs().max() > 1e-3  # the bias is there
    other, _ = head.slot_outputs(h, torch.tensor([6, 7, 5]))
    assert (other[0] - logits[0]).abs().max() > 1e-3  # and reads prev, row by row
    torch.testing.assert_close(other[1:], logits[1:], rtol=1e-12, atol=1e-12)


# ---- the loss ----------------------------------------------------------------------------------------------------

def hand_case():
    """Two slots over a 3-token draft vocab, numbers chosen so the terms come out by hand:
    slot 1 (k=1, w=1): q = (1/4, 1/2, 1/4), p = (0, 1, 0), m = 1 -> L1 = 1, alpha = 1/2, CE = ln 2 (label 1),
        soft CE = ln 2, confidence sigmoid(0) = 1/2 -> BCE = ln 2
    slot 2 (k=2, w=e^-1/4): q = (1/3, 1/3, 1/3), p = (1, 0, 0), m = 3/4 -> L1 = 5/12 + 2/3 + 1/4 = 4/3,
        alpha = 1/3, no label (no CE), soft CE = ln 3, confidence sigmoid(ln 2) = 2/3 ->
        BCE = -(1/3 ln 2/3 + 2/3 ln 1/3)"""
    d = torch.float64
    q_logits = torch.tensor([[0.0, math.log(2), 0.0], [0.0, 0.0, 0.0]], dtype=d, requires_grad=True)
    conf_logits = torch.tensor([0.0, math.log(2)], dtype=d, requires_grad=True)
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=d)
    in_mass = torch.tensor([1.0, 0.75], dtype=d)
    label, has_label = torch.tensor([1, 0]), torch.tensor([True, False])
    w2 = math.exp(-1 / 4)  # slot_decay 4: the second drafted slot
    weight = torch.tensor([1.0, w2], dtype=d)
    return (q_logits, conf_logits, p, in_mass, label, has_label, weight), w2


def test_loss_equals_the_hand_computed_case():
    args, w2 = hand_case()
    ln2, ln3 = math.log(2), math.log(3)
    bce2 = -(1 / 3 * math.log(2 / 3) + 2 / 3 * math.log(1 / 3))
    l1_term = (1 * 1.0 + w2 * 4 / 3) / (1 + w2)
    bce_term = (ln2 + w2 * bce2) / (1 + w2)
    loss, terms = dspark_terms(*args, DSparkConfig())
    assert loss.item() == pytest.approx(0.1 * ln2 + 0.9 * l1_term + 1.0 * bce_term, rel=1e-12)
    torch.testing.assert_close(terms["alpha"], torch.tensor([0.5, 1 / 3], dtype=torch.float64))
    soft, _ = dspark_terms(*args, DSparkConfig(ce="soft"))
    assert soft.item() == pytest.approx(0.1 * (ln2 + w2 * ln3) / (1 + w2) + 0.9 * l1_term + bce_term, rel=1e-12)
    ce_only, _ = dspark_terms(*args, DSparkConfig(ce_weight=1.0, l1_weight=0.0, confidence_weight=0.0))
    assert ce_only.item() == pytest.approx(ln2, rel=1e-12)
    bce_only, _ = dspark_terms(*args, DSparkConfig(ce_weight=0.0, l1_weight=0.0, confidence_weight=2.0))
    assert bce_only.item() == pytest.approx(2 * bce_term, rel=1e-12)


def test_the_confidence_target_is_detached():
    """The BCE trains the confidence only: its gradient never reaches the draft logits."""
    (q_logits, conf_logits, *rest), _ = hand_case()
    loss, _ = dspark_terms(q_logits, conf_logits, *rest, DSparkConfig(ce_weight=0.0, l1_weight=0.0))
    loss.backward()
    assert q_logits.grad is None or float(q_logits.grad.abs().max()) == 0.0
    assert float(conf_logits.grad.abs().max()) > 0


@pytest.fixture(scope="module")
def rows():
    """A float64 tiny target, a random DSpark drafter and two training rows (tests/helpers.py)."""
    target = load_target(TargetConfig(name="tiny", dtype="float64"))
    head = random_dspark(target, dtype=torch.float64)
    torch.manual_seed(2)
    return (target, head, *tiny_training_rows(target, head))


ANCHORS = torch.tensor([[1, 4, 5, 9, 12], [2, 3, 7, 8, 0]])  # row 1's last block is padding
REAL = torch.tensor([[True] * 5, [True] * 4 + [False]])


@pytest.mark.parametrize("ce", ["token", "soft"])
def test_batched_loss_equals_each_block_on_its_own(rows, ce):
    """Every counted slot recomputed from its block run alone (as at inference), its Markov input the true previous
    token, its label the data's next token, its weight exp(-(k-1)/slot_decay): the same loss and statistics."""
    target, head, input_ids, attention_mask, loss_mask, aux, tgt = rows
    cfg = DSparkConfig(block_size=BLOCK, slot_decay=2.0, ce=ce)
    T = input_ids.shape[1]
    valid = loss_mask.bool() & attention_mask.bool()
    draft_of = {int(t): i for i, t in enumerate(torch.nonzero(head.t2d).squeeze(1))}
    slots = []
    with torch.no_grad():
        loss, stats = dspark_loss(head, input_ids, attention_mask, loss_mask, aux, tgt, ANCHORS, REAL, cfg)
        for b in range(2):
            for j in range(ANCHORS.shape[1]):
                a = int(ANCHORS[b, j])
                if not REAL[b, j]:
                    continue
                ids = torch.tensor([[int(input_ids[b, a])] + [head.mask_token_id] * (BLOCK - 1)])
                mask = torch.ones(1, 1, BLOCK, a + BLOCK, dtype=torch.bool)
                h, _ = head(ids, torch.arange(a, a + BLOCK)[None], head.context(aux[b:b + 1, :a]),
                            torch.arange(a)[None], mask)
                for k in range(1, BLOCK):
                    u = a + k - 1
                    if u > T - 1 or not valid[b, u]:
                        continue
                    logits, conf = head.slot_outputs(h[0, k], input_ids[b, u])
                    y = int(input_ids[b, u + 1]) if u + 1 <= T - 1 and attention_mask[b, u + 1] else -1
                    w = math.exp(-(k - 1) / 2.0) * bool(tgt.argmax_in_draft[b, u])
                    slots.append((logits, conf, tgt.probs[b, u], tgt.in_mass[b, u], draft_of.get(y, 0), y in draft_of, w,
                                  k))
        ref, _ = dspark_terms(torch.stack([s[0] for s in slots]), torch.stack([s[1] for s in slots]),
                              torch.stack([s[2] for s in slots]), torch.stack([s[3] for s in slots]),
                              torch.tensor([s[4] for s in slots]), torch.tensor([s[5] for s in slots]),
                              torch.tensor([s[6] for s in slots], dtype=torch.float64), cfg)
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)  # the loss runs in float32 (as every method's)
    assert stats.shape == (BLOCK - 1, 12) and int(stats[:, 4].sum()) == len(slots)
    for k in range(1, BLOCK):
        assert int(stats[k - 1, 4]) == sum(s[7] == k for s in slots)
    metrics = summarize(stats)
    assert 1.0 <= metrics["etau_greedy"] <= BLOCK and {"confidence_0", "confidence_bce_2", "confidence_error_1",
                                                       "alpha_1"} <= set(metrics)
    assert 0 < metrics["confidence_0"] < 1


def test_config_refusals():
    cfg = DSparkConfig()
    assert (cfg.markov_rank, cfg.ce_weight, cfg.l1_weight, cfg.confidence_weight, cfg.slot_decay, cfg.ce) == (
        256, 0.1, 0.9, 1.0, 4.0, "token")
    with pytest.raises(DraftsmithError, match="method.ce"):
        DSparkConfig(ce="kl")
    with pytest.raises(DraftsmithError, match="method.slot_decay"):
        DSparkConfig(slot_decay=0)
    with pytest.raises(DraftsmithError, match="method.markov_rank"):
        DSparkConfig(markov_rank=0)


# ---- warm start, folders -----------------------------------------------------------------------------------------

def test_warm_start_loads_the_dflash_backbone_exactly(tiny_target, tmp_path):
    torch.manual_seed(3)
    dflash = DFlashHead(dflash_config_from_target(tiny_target.model.config, 200, LAYERS, BLOCK,
                                                  tiny_target.vocab_size - 5, tiny_target.aux_layer_ids))
    dflash.init_from_target(tiny_target.model, *build_vocab_map(torch.randint(0, 100, (tiny_target.vocab_size,)), 200))
    randomize_weights(dflash, ("fc", "layers", "hidden_norm", "norm"))
    folder = save_dflash(dflash, tmp_path / "dflash", dtype=torch.float32)
    cfg = DSparkConfig(draft_vocab_size=200, num_layers=LAYERS, block_size=BLOCK, markov_rank=RANK, init=str(folder))
    head = new_dspark(tiny_target, cfg, None, None)
    theirs, ours = dflash.state_dict(), head.state_dict()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert head.mask_token_id == tiny_target.vocab_size - 5  # the folder's, with method.mask_token_id unset
    assert set(ours) - set(theirs) == {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                                       "confidence_head.proj.weight", "confidence_head.proj.bias"}
    with pytest.raises(DraftsmithError, match=r"has num_layers 2, but method.num_layers=3: set method.num_layers=2"):
        new_dspark(tiny_target, DSparkConfig(draft_vocab_size=200, num_layers=3, block_size=BLOCK, init=str(folder)),
                   None, None)
    dspark = save_dspark(head, tmp_path / "dspark")
    with pytest.raises(DraftsmithError, match=r"is not a DFlash head folder \(its config.json declares architectures "
                                              r"\['DSparkDraftModel'\]\); DSpark starts from"):
        new_dspark(tiny_target, DSparkConfig(draft_vocab_size=200, num_layers=LAYERS, block_size=BLOCK,
                                             init=str(dspark)), None, None)


def test_folder_round_trip_and_refusals(tiny_target, tmp_path):
    head = random_dspark(tiny_target)
    folder = save_dspark(head, tmp_path / "d", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config["sample_from_anchor"] is False
    assert (config["markov_rank"], config["markov_head_type"], config["enable_confidence_head"],
            config["confidence_head_with_markov"]) == (RANK, "vanilla", True, True)
    assert config["mask_token_id"] == head.mask_token_id == config["dflash_config"]["mask_token_id"]
    assert config["target_layer_ids"] == [i - 1 for i in tiny_target.aux_layer_ids] and config["block_size"] == BLOCK
    entry = method_for_folder(folder)
    assert entry.name == "dspark" and methods()["dspark"].formats.keys() == {"dspark", "gguf", "speculators"}
    back = entry.load(folder, tiny_target)
    for name, tensor in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    for key, value in (("sample_from_anchor", True), ("markov_head_type", "gated"), ("sample_from_anchor", None)):
        bad = dict(config, **{key: value})
        (folder / "config.json").write_text(json.dumps(bad))
        with pytest.raises(DraftsmithError, match=rf"has {key}={value!r}; draftsmith's DSpark drafter computes"):
            load_dspark(folder)
    assert entry.unserved_formats == {}


# ---- `draftsmith train method=dspark`: the shared trainer, exact resume ----------------------------------------

def _train_cfg(data, out, deepspeed="none", mode="auto", **kw):
    method = DSparkConfig(draft_vocab_size=128, num_layers=2, block_size=BLOCK, max_anchors=8, markov_rank=RANK)
    return tiny_train_cfg(data, out, method, deepspeed, mode, **kw)


def test_train_offline_resume_is_exact(tiny_data, tmp_path):
    full, _, head = check_resume_is_exact(_train_cfg, tiny_data, tmp_path, "none", method="dspark", depths=BLOCK - 1,
                                          own_tensor="markov_head.markov_w2.weight", layers=2)
    assert {"confidence_0", "confidence_bce_2"} <= set(full["metrics"]) and head.markov_rank == RANK


def test_the_method_composes_from_the_cli(compose_cfg):
    cfg = compose_cfg("train", "method=dspark", "method.ce=soft", "method.init=runs/dflash/final", "data=d", "out=o")
    assert cfg.method.name == "dspark" and cfg.method.ce == "soft" and cfg.method.markov_rank == 256


# ---- the built-in decoder ----------------------------------------------------------------------------------------

AUX = [0, 1, 2]  # HF hidden_states indices of a 2-layer bare target


def _head(target, used: list[int], seed=4, layers=2, block_size=8, aux=AUX, markov=3.0):
    torch.manual_seed(seed)
    V, Vd = target.config.vocab_size, len(used)
    head = DSparkHead(dspark_config_from_target(target.config, Vd, layers, block_size, V - 1, aux, RANK)).double()
    init_from_used_tokens(head, target, used)
    randomize_weights(head, ("fc", "layers", "hidden_norm", "markov_head", "confidence_head"))
    with torch.no_grad():
        head.markov_head.markov_w2.weight.mul_(markov)  # a bias that changes which token wins
    return head.eval()


class RecordingProposer(DSparkProposer):
    """Keeps, per cycle, the committed sequence and the draft."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rounds = []

    def propose(self, drafting, sampling, generator=None):
        seq = list(self.seq)
        draft = super().propose(drafting, sampling, generator)
        self.rounds.append((seq, draft))
        return draft


def from_scratch(head, target, seq, prevs, k):
    """The drafter on the whole committed sequence, no cache: the block [x_{L-1}, k masks] over the context f_0 ..
    f_{L-2}, every query seeing every key; then its first len(prevs) slots with those Markov inputs (the bonus token
    x_{L-1} for slot 1, then the tokens drafted before each): (logits (n, Vd), confidence logits (n,))."""
    L = len(seq)
    with torch.no_grad():
        hs = target(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in AUX], dim=-1)  # (1, L-1, 3H)
        ids = torch.tensor([[seq[-1]] + [head.mask_token_id] * k])
        mask = torch.ones(1, 1, k + 1, L + k, dtype=torch.bool)
        h, _ = head(ids, torch.arange(L - 1, L + k)[None], head.context(aux), torch.arange(L - 1)[None], mask)
        return head.slot_outputs(h[0, 1:len(prevs) + 1], torch.tensor(prevs))


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0),
                                      SamplingConfig(temperature=0.8, top_k=5, top_p=0.9)],
                         ids=["greedy", "T1", "topk-topp"])
def test_slot_by_slot_drafts_are_what_the_drafter_computes_from_scratch(sampling):
    target = peaked_llama(12)
    head = _head(target, [0, 1, 2, 4, 5, 7, 8, 10, 11])
    proposer = RecordingProposer(head, 12, 96)
    res = speculative_generate(TargetRunner(target, 96, AUX), proposer, torch.tensor([3, 1, 4, 1, 5, 9, 2, 6]), 40,
                               sampling, DraftingConfig("chain", 4), [], generator=torch.Generator().manual_seed(0))
    assert len(res.tokens) == 40 and len(proposer.rounds) > 3
    draft_ids = head.draft_to_target(torch.arange(head.config.draft_vocab_size))
    for seq, draft in proposer.rounds:
        logits, _ = from_scratch(head, target, seq, [seq[-1]] + draft.tokens[:-1], 4)
        if sampling.greedy:
            assert draft.tokens == draft_ids[logits.argmax(-1)].tolist() and draft.q is None
        else:
            q = torch.zeros(len(draft.tokens), 12, dtype=torch.float64)
            q[:, draft_ids] = process_logits(logits, sampling)
            torch.testing.assert_close(draft.q, q, rtol=1e-9, atol=1e-12)


def test_stop_below_stops_before_the_first_unsure_slot_and_stays_lossless():
    V, K, stop = 12, 5, 0.5
    target = peaked_llama(V)
    head = _head(target, list(range(V)))
    with torch.no_grad():
        head.confidence_head.proj.bias.zero_()  # confidences on both sides of 1/2
    prompt = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    runner = TargetRunner(target, 96, AUX)
    fixed = speculative_generate(runner, DSparkProposer(head, V, 96), prompt, 30, SamplingConfig(),
                                 DraftingConfig("chain", K), [])
    proposer = RecordingProposer(head, V, 96)
    dynamic = speculative_generate(runner, proposer, prompt, 30, SamplingConfig(), DraftingConfig("chain", K,
                                                                                                  stop_below=stop), [])
    assert dynamic.tokens == fixed.tokens  # lossless either way
    cut = 0
    for seq, draft in proposer.rounds:
        n = len(draft.tokens)
        # the confidence of the slot after the kept ones is below the threshold, each kept one's is not
        _, conf = from_scratch(head, target, seq, ([seq[-1]] + draft.tokens)[:K], K)
        sure = torch.sigmoid(conf) >= stop
        assert sure[:n].all() and (n == K or not sure[n])
        cut += n < K
    assert 0 < cut < len(proposer.rounds), (cut, len(proposer.rounds))  # some drafts were cut, some were not


def test_more_tokens_than_a_trained_block_is_refused():
    target = peaked_llama(12)
    proposer = DSparkProposer(_head(target, list(range(12)), block_size=4), 12, 96)
    with pytest.raises(DraftsmithError, match=r"K=4 .* more than the 3 tokens a block of this DSpark head drafts"):
        speculative_generate(TargetRunner(target, 96, AUX), proposer, torch.tensor([3, 1, 4]), 8, SamplingConfig(),
                             DraftingConfig("chain", 4), [])


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_is_token_identical_to_target_only(k):
    tiny = load_target(TargetConfig(name="tiny", dtype="float64"))
    torch.manual_seed(0)
    used = torch.sort(torch.randperm(tiny.vocab_size)[:200]).values.tolist()
    head = _head(tiny.model, used, aux=tiny.aux_layer_ids)
    check_greedy_is_token_identical_to_target_only(tiny, DSparkProposer(head, tiny.vocab_size, 256), k)


def _sampled_pvalue(sampling):
    target = peaked_llama(SAMPLING_V, seed=0, scale=60, layers=1)
    runner = TargetRunner(target, 32, [0, 1, 1])
    head = _head(target, [0, 1, 2, 4, 5, 7], seed=3, layers=2, aux=[0, 1, 1])
    with torch.no_grad():
        head.lm_head.weight.mul_(60)
    return speculative_sampling_pvalue(runner, DSparkProposer(head, SAMPLING_V, 32), target, sampling)


# the seeded statistical test (2500 generations, about 13 s here) and its negative control, shared with every
# one-forward proposer; run at T = 1 only (top-k / top-p reach q exactly: the from-scratch test above), to keep the
# file within its time budget
_matches, test_negative_control_resampling_from_p_fails = statistical_sampling_tests(_sampled_pvalue)


@pytest.mark.slow  # 2500 seeded generations
def test_sampling_matches_target_distribution():
    pval, stat, df = _sampled_pvalue(SamplingConfig(temperature=1.0))
    assert pval > 1e-3, (stat, df)


# ---- `draftsmith eval head=<dspark folder>`: the stage end to end ----------------------------------------------

def test_eval_of_a_dspark_folder(tiny_target, questions, tmp_path):
    """The eval stage loads the folder through the method table, decodes token-identically with target-only
    (greedy, confidence stops on) and charges the block drafter one forward per cycle in its cost model."""
    head = random_dspark(tiny_target, draft_vocab=128)
    folder = save_dspark(head, tmp_path / "head", manifest_target=tiny_target.identity())
    report = run_eval(eval_cfg(questions, tmp_path / "eval", f"head={folder}", "drafting.num_speculative_tokens=3",
                               "drafting.stop_below=0.2"))
    assert report["method"] == "dspark" and report["greedy_identical_fraction"] == 1.0
    table = report["cost_model"]["table"]
    assert len({r["t_draft_s"] for r in table}) == 1 and [r["k"] for r in table] == [1, 2, 3]  # K=1, 2 borrow K=3's
