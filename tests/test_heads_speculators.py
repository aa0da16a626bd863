"""Outside check: vLLM's `speculators` package loads our speculators-format export and computes
the same logits as our head, step 0 and the training-time-test steps after it, with and without the
EAGLE-3.1 norms it holds; and its DSparkDraftModel loads our DSpark export (`export format=speculators`) and
computes our Markov-biased logits and confidence logits on the same blocks.

Needs `pip install --no-deps "speculators==0.9.*"` plus its light dependencies (see the CI setup).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (assert_ttt_steps_close, eagle3_ttt_logits, load_speculators_model, random_head,
                     random_ttt_inputs, speculators_eagle3_ttt_logits)

from draftsmith.heads.eagle3_folders import save_speculators

speculators_eagle3 = pytest.importorskip("speculators.models.eagle3")

TTT_STEPS = 3


# EAGLE-3.1 norms speculators 0.9 holds (its config refuses norm_before_fc with fc_norm)
NORMS = {"plain": {}, "norm_before_fc+norm_output": {"norm_before_fc": True, "norm_output": True},
         "fc_norm+norm_output": {"fc_norm": True, "norm_output": True}}


@pytest.mark.parametrize("norms", list(NORMS))
def test_speculators_loads_our_export_and_agrees_on_logits(tiny_target, verifier_folder, tmp_path, norms):
    head = random_head(tiny_target, **NORMS[norms])
    folder = save_speculators(head, tmp_path / "spec", verifier=str(verifier_folder),
                              manifest_target=tiny_target.identity(), dtype=torch.float32)
    model = load_speculators_model(speculators_eagle3.Eagle3SpeculatorConfig, speculators_eagle3.Eagle3DraftModel,
                                   folder)
    assert model.config.eagle_aux_hidden_state_layer_ids == tiny_target.aux_layer_ids
    assert torch.equal(model.d2t, head.d2t) and torch.equal(model.t2d, head.t2d)
    # our weights, not the verifier's, were loaded (speculators fills only what is missing)
    assert torch.equal(model.lm_head.weight, head.lm_head.weight)
    assert (model.input_norm is not None, model.fc_norm is not None, model.config.norm_output) == (
        head.input_norm is not None, head.fc_norm is not None, head.norm_output)
    if head.input_norm is not None:  # its loader ignores a missing input_norm.weight: ours must be the one it holds
        assert torch.equal(model.input_norm.weight, head.input_norm.weight)
    for mine, theirs in zip(head.fc_norm or [], model.fc_norm or []):
        assert torch.equal(mine.weight, theirs.weight)

    ids, aux, pos = random_ttt_inputs(tiny_target.vocab_size, 3 * tiny_target.hidden_size, T=13, seed=3)
    theirs = speculators_eagle3_ttt_logits(model, ids, aux, pos, TTT_STEPS)
    assert_ttt_steps_close(eagle3_ttt_logits(head, ids, aux, pos, TTT_STEPS), theirs, TTT_STEPS, atol=1e-5, rtol=1e-5)


# ---- DSpark: speculators' DSparkDraftModel loads `export format=speculators` ---------------------------------------

DSPARK_BLOCK, DSPARK_RANK, DSPARK_VOCAB = 4, 8, 64


def random_dspark(target):
    """A 2-layer DSpark drafter of the tiny target, every weight but the copied embeddings random (the Markov
    weights large enough to move the logits)."""
    from helpers import randomize_weights

    from draftsmith.heads.dspark import DSparkHead, dspark_config_from_target
    from draftsmith.heads.vocab import build_vocab_map

    torch.manual_seed(0)
    head = DSparkHead(dspark_config_from_target(target.model.config, DSPARK_VOCAB, 2, DSPARK_BLOCK,
                                                target.vocab_size - 1, target.aux_layer_ids, DSPARK_RANK))
    head.init_from_target(target.model, *build_vocab_map(torch.randint(0, 1000, (target.vocab_size,)), DSPARK_VOCAB))
    with torch.no_grad():
        randomize_weights(head, ("fc", "layers", "hidden_norm", "norm", "lm_head", "markov_head", "confidence_head"))
    return head.eval()


@torch.no_grad()
def dspark_block_outputs(head, ids, aux, anchor):
    """Ours, teacher forced as in training: every block's drafted slots (k >= 1), each with the Markov bias of the
    true previous token x_{a+k-1} -> (logits (n*(bs-1), Vd), confidence logits (n*(bs-1),))."""
    from draftsmith.heads.dflash import block_mask
    from draftsmith.train.block import block_forward

    T, bs = ids.shape[1], head.block_size
    h = block_forward(head, ids, aux, anchor, block_mask(anchor, bs, torch.ones(1, T, dtype=torch.bool)))[0]
    slots = [(j * bs + k, int(a) + k - 1) for j, a in enumerate(anchor[0]) for k in range(1, bs)]
    rows, prevs = torch.tensor([r for r, _ in slots]), ids[0, [p for _, p in slots]]
    return head.slot_outputs(h[rows], prevs)


@torch.no_grad()
def speculators_dspark_block_outputs(model, ids, aux, anchor, monkeypatch):
    """Theirs: speculators' own DSpark training forward on the same blocks (its anchor sampling replaced by ours), the
    biased logits and the confidence logits read where it hands them to its loss, at the drafted slots."""
    import speculators.models.dflash.core as dflash_core
    import speculators.models.dspark.core as dspark_core

    T, bs, n = ids.shape[1], model.block_size, anchor.shape[1]
    seen = {}

    def capture(logits, targets, confidence_logits, *args, **kwargs):
        seen.update(logits=logits[0], confidence=confidence_logits[0])
        return torch.zeros(()), {}

    monkeypatch.setattr(dflash_core, "select_anchors", lambda loss_mask, k, b: (anchor[0], torch.ones(k, dtype=torch.bool)))
    monkeypatch.setattr(dspark_core, "compute_metrics", capture)
    H = model.config.transformer_layer_config.hidden_size
    model(hidden_states=aux, input_ids=ids, loss_mask=torch.ones(1, T), verifier_last_hidden_states=torch.zeros(1, T, H),
          document_ids=torch.zeros(1, T, dtype=torch.long), max_anchors=n)
    drafted = torch.tensor([j * bs + k for j in range(n) for k in range(1, bs)])
    return seen["logits"][drafted].float(), seen["confidence"][drafted].float()


def test_speculators_loads_our_dspark_export_and_agrees_on_logits_and_confidence(tiny_target, verifier_folder, tmp_path,
                                                                                 monkeypatch):
    """`export format=speculators` of a DSpark drafter, loaded by speculators 0.9's DSparkSpeculatorConfig and
    DSparkDraftModel: the same layout (sample_from_anchor false), vocab maps and heads, and on the same four blocks
    the same Markov-biased logits and confidence logits as ours. A copy with the Markov weights swapped between
    two rows of W1 must not agree (the check sees the Markov head)."""
    from safetensors.torch import load_file, save_file

    from draftsmith.configs import compose
    from draftsmith.export import run as export
    from draftsmith.heads.dspark_folders import save_dspark

    # speculators 0.9 (scripts/setup.sh) ships DSpark: a missing module fails this check rather than skipping it
    from speculators.models import dspark as speculators_dspark
    head = random_dspark(tiny_target)
    trained = save_dspark(head, tmp_path / "trained", manifest_target=tiny_target.identity())
    folder = export(compose("export", [f"head={trained}", "format=speculators", f"verifier={verifier_folder}",
                                       "dtype=float32", f"out={tmp_path / 'spec'}"]))
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_config"]["algorithm"] == "dspark"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3

    def load(path):
        model = load_speculators_model(speculators_dspark.DSparkSpeculatorConfig, speculators_dspark.DSparkDraftModel,
                                       path)
        model.embed_tokens.weight.data.copy_(head.embed_tokens.weight)  # speculators never saves them (the verifier's)
        return model

    model = load(folder)
    assert type(model).__name__ == "DSparkDraftModel" and model.config.sample_from_anchor is False
    assert (model.config.markov_rank, model.config.markov_head_type) == (DSPARK_RANK, "vanilla")
    assert model.mask_token_id == head.mask_token_id and len(model.layers) == 2 and model.block_size == DSPARK_BLOCK
    assert torch.equal(model.d2t, head.d2t) and torch.equal(model.t2d, head.t2d)
    assert model.target_layer_ids == tiny_target.aux_layer_ids
    assert torch.equal(model.markov_head.markov_w1.weight, head.markov_head.markov_w1.weight)

    g = torch.Generator().manual_seed(1)
    T = 16
    ids = torch.randint(0, tiny_target.vocab_size - 1, (1, T), generator=g)
    aux = torch.randn(1, T, head.fc.in_features, generator=g)
    anchor = torch.tensor([[1, 5, 6, 11]])
    ours = dspark_block_outputs(head, ids, aux, anchor)
    theirs = speculators_dspark_block_outputs(model, ids, aux, anchor, monkeypatch)
    assert ours[0].shape == theirs[0].shape == (4 * (DSPARK_BLOCK - 1), DSPARK_VOCAB)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[1], theirs[1], atol=1e-5, rtol=1e-5)

    # negative control: the rows of the previous tokens' W1 swapped, everything else as exported
    tensors = load_file(str(folder / "model.safetensors"))
    w1 = tensors["markov_head.markov_w1.weight"]
    a, b = int(ids[0, 1]), int(ids[0, 5])
    assert a != b
    w1[[a, b]] = w1[[b, a]]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    broken = speculators_dspark_block_outputs(load(folder), ids, aux, anchor, monkeypatch)
    assert not torch.allclose(ours[0], broken[0], atol=1e-3, rtol=1e-3)
