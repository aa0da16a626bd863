"""Outside check: vLLM's `speculators` package loads our speculators-format export and computes
the same logits as our head, step 0 and the training-time-test steps after it, with and without the
EAGLE-3.1 norms it holds.

Needs `pip install --no-deps "speculators==0.9.*"` plus its light dependencies (see the CI setup).
"""

from __future__ import annotations

import pytest
import torch
from method_checks import (assert_ttt_steps_close, eagle3_ttt_logits, load_speculators_model, random_ttt_inputs,
                           speculators_eagle3_ttt_logits, verifier_folder)  # noqa: F401  (verifier_folder: a fixture)
from test_heads_checkpoint import random_head

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
