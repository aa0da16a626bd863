"""Outside check: vLLM's `speculators` package loads our speculators-format export and computes
the same logits as our head, step 0 and the training-time-test steps after it, with and without the
EAGLE-3.1 norms it holds.

Needs `pip install --no-deps "speculators==0.9.*"` plus its light dependencies (see the CI setup).
"""

from __future__ import annotations

import pytest
import torch
from test_heads_checkpoint import random_head

from draftsmith.heads.eagle3 import ttt_mask
from draftsmith.heads.eagle3_folders import save_speculators
from draftsmith.heads.kit import ConcatKVCache

speculators_eagle3 = pytest.importorskip("speculators.models.eagle3")

TTT_STEPS = 3


@pytest.fixture
def verifier_folder(tiny_target, tmp_path, monkeypatch):
    """The tiny target as an HF folder: speculators reads the verifier's config and norm from it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "verifier"
    tiny_target.model.save_pretrained(folder)
    return folder


def load_with_speculators(folder):
    """speculators' own loader, with SDPA attention (its default flex attention has no CPU backward)."""
    config = speculators_eagle3.Eagle3SpeculatorConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "sdpa"
    return speculators_eagle3.Eagle3DraftModel.from_pretrained(str(folder), config=config).eval()


@torch.no_grad()
def speculators_logits(model, ids, aux, pos) -> list[torch.Tensor]:
    """Per-step logits of speculators' training-time-test forward (one document, teacher-forced ids)."""
    steps = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: steps.append(out.detach()))
    try:
        model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), position_ids=pos,
              ttt_steps=TTT_STEPS)
    finally:
        hook.remove()
    return steps


@torch.no_grad()
def our_logits(head, ids, aux, pos) -> list[torch.Tensor]:
    """The same unroll with our head: step k reads ids shifted by k, the previous step's output, pos + k."""
    T = ids.shape[1]
    cache, hidden, step_ids, steps = ConcatKVCache(), head.fuse(aux), ids, []
    for k in range(TTT_STEPS):
        hidden, logits = head(step_ids, hidden, pos + k, ttt_mask(T, k), kv_cache=cache)
        steps.append(logits)
        step_ids = torch.cat([ids[:, 1 + k:], ids.new_zeros(1, 1 + k)], dim=1)
    return steps


# EAGLE-3.1 norms speculators 0.9 holds (its config refuses norm_before_fc with fc_norm)
NORMS = {"plain": {}, "norm_before_fc+norm_output": {"norm_before_fc": True, "norm_output": True},
         "fc_norm+norm_output": {"fc_norm": True, "norm_output": True}}


@pytest.mark.parametrize("norms", list(NORMS))
def test_speculators_loads_our_export_and_agrees_on_logits(tiny_target, verifier_folder, tmp_path, norms):
    head = random_head(tiny_target, **NORMS[norms])
    folder = save_speculators(head, tmp_path / "spec", verifier=str(verifier_folder),
                              manifest_target=tiny_target.identity(), dtype=torch.float32)
    model = load_with_speculators(folder)
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

    g = torch.Generator().manual_seed(3)
    T = 13
    ids = torch.randint(0, tiny_target.vocab_size, (1, T), generator=g)
    aux = torch.randn(1, T, 3 * tiny_target.hidden_size, generator=g)
    pos = torch.arange(T)[None]
    theirs, ours = speculators_logits(model, ids, aux, pos), our_logits(head, ids, aux, pos)
    assert len(theirs) == len(ours) == TTT_STEPS
    for k, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"TTT step {k}: {m}")
