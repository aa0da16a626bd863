"""P-EAGLE folders: the parallel-drafting folder vLLM loads (names, shapes, dtypes, config fields, round trip),
the export CLI, and the outside check: speculators' own PEagleDraftModel loads our speculators-format export and
computes our drafter's logits on the same slots (a deliberately mis-mapped export fails that check)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (DRAFT_VOCAB, PEAGLE_LAYERS, causal_mask, check_a_folder_without_embeddings_needs_the_targets,
                     check_cli_export_both_formats, check_speculators_holds_our_head, layer_weight_names,
                     load_speculators_model, random_peagle, tensors_of)
from safetensors.torch import load_file, save_file

from draftsmith.core import DraftsmithError
from draftsmith.cli import main
from draftsmith.heads.peagle_folders import load_peagle, save_peagle, save_speculators_peagle
from draftsmith.core.methods import method_for_folder
from draftsmith.train.peagle import Slots, parallel_forward, sample_slots

@torch.no_grad()
def inference_logits(head, T: int = 9, K: int = 4, seed: int = 1) -> torch.Tensor:
    """The inference layout: T real slots then K-1 mask slots, causal; logits of the last real slot and the mask slots."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(0, head.config.vocab_size, (T,), generator=g), torch.full((K - 1,), head.mask_token_id)])
    aux = torch.randn(1, T, head.fc.in_features, generator=g)
    hidden = torch.cat([head.fuse(aux), head.mask_fused()[None, None].expand(1, K - 1, -1)], 1)
    return head(ids[None], hidden, torch.arange(T + K - 1)[None], causal_mask(T + K - 1))[1][0, T - 1:].float()


def expected_names(layers: int) -> set[str]:
    names = {"fc.weight", "mask_hidden", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight",
             "layers.0.hidden_norm.weight"}
    return names | layer_weight_names(layers)


def test_parallel_drafting_folder_names_shapes_dtypes_config(tiny_target, tmp_path):
    head = random_peagle(tiny_target)
    folder = save_peagle(head, tmp_path / "p", manifest_target=tiny_target.identity(), dtype=torch.bfloat16)
    tensors = tensors_of(folder)
    assert set(tensors) == expected_names(PEAGLE_LAYERS)
    H, H_t = head.config.hidden_size, tiny_target.hidden_size
    assert tensors["mask_hidden"].shape == (1, 3 * H_t) and tensors["mask_hidden"].dtype == torch.bfloat16
    assert tensors["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * H  # [embedding; hidden]
    assert tensors["layers.1.self_attn.q_proj.weight"].shape[1] == H
    assert "layers.1.hidden_norm.weight" not in tensors
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["embed_tokens.weight"].shape == (tiny_target.vocab_size, H)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["parallel_drafting"] is True and config["ptd_token_id"] == tiny_target.vocab_size - 1
    assert config["num_hidden_layers"] == PEAGLE_LAYERS and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["vocab_size"] == tiny_target.vocab_size and config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "bfloat16"
    assert method_for_folder(folder).name == "peagle"  # not EAGLE-3's, whose architecture it shares


def test_round_trip_and_embeddings(tiny_target, tmp_path):
    head = random_peagle(tiny_target)
    back = load_peagle(save_peagle(head, tmp_path / "p"))
    assert len(back.layers) == PEAGLE_LAYERS and back.mask_token_id == head.mask_token_id
    torch.testing.assert_close(inference_logits(back), inference_logits(head), rtol=0, atol=0)
    # trained embeddings are always written; frozen ones may be left to the target's
    assert "embed_tokens.weight" in tensors_of(save_peagle(head, tmp_path / "a", include_embeddings=False))
    frozen = random_peagle(tiny_target, train_embeddings=False)
    check_a_folder_without_embeddings_needs_the_targets(save_peagle, load_peagle, frozen, tmp_path / "b", tiny_target,
                                                        inference_logits)


def test_a_wrong_shape_or_missing_mask_hidden_is_refused(tiny_target, tmp_path):
    folder = save_peagle(random_peagle(tiny_target), tmp_path / "p")
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "mask_hidden"}, str(folder / "model.safetensors"))
    with pytest.raises(DraftsmithError, match="no tensor 'mask_hidden'"):
        load_peagle(folder)
    save_file({**tensors, "mask_hidden": tensors["mask_hidden"][:, :5]}, str(folder / "model.safetensors"))
    with pytest.raises(DraftsmithError, match="'mask_hidden' has shape"):
        load_peagle(folder)


def test_cli_export_both_formats(tiny_target, tmp_path, capsys):
    own, config = check_cli_export_both_formats(save_peagle, random_peagle(tiny_target), tiny_target, tmp_path, capsys,
                                                method="peagle", architecture="PEagleDraftModel",
                                                layers=PEAGLE_LAYERS, k=5)
    assert own["parallel_drafting"] is True
    assert config["mask_token_id"] == tiny_target.vocab_size - 1 and config["embed_requires_grad"] is True
    assert config["eagle_aux_hidden_state_layer_ids"] == tiny_target.aux_layer_ids
    tensors = tensors_of(tmp_path / "s")
    assert set(tensors) == expected_names(PEAGLE_LAYERS)
    assert tensors["mask_hidden"].shape == (1, 1, 3 * tiny_target.hidden_size)


# ---- the outside check: speculators' PEagleDraftModel ------------------------------------------------------

speculators_peagle = pytest.importorskip("speculators.models.peagle")


@torch.no_grad()
def speculators_logits(model, next_ids, aux, slots: Slots, monkeypatch) -> torch.Tensor:
    """speculators' own training forward on our slots (its COD sampling replaced by ours): the logits it scores."""
    import speculators.models.peagle.core as core

    anchor, depth = slots.anchor[0], slots.depth[0]
    monkeypatch.setattr(core, "generate_cod_sample_indices", lambda **kw: (anchor, depth))
    captured = {}

    def keep(logits, **kw):
        captured["logits"] = logits
        return logits.sum() * 0, {}

    monkeypatch.setattr(core, "compute_metrics", keep)
    T = next_ids.shape[1]
    model(hidden_states=aux, input_ids=next_ids, document_ids=torch.zeros_like(next_ids),
          verifier_last_hidden_states=torch.zeros(1, T, model.hidden_size), loss_mask=torch.ones(1, T))
    return captured["logits"][0]


def compare_with_speculators(head, folder, monkeypatch, T: int = 16):
    """(our logits, speculators' logits) on one sequence's sampled slots, all depths."""
    model = load_speculators_model(speculators_peagle.PEagleSpeculatorConfig, speculators_peagle.PEagleDraftModel,
                                   folder)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, head.config.vocab_size, (1, T), generator=g)
    aux = torch.randn(1, T, head.fc.in_features, generator=g)
    slots = sample_slots(torch.ones(1, T, dtype=torch.bool), 5, 0.7, 0.2, generator=g)
    with torch.no_grad():
        ours = head.logits(parallel_forward(head, ids, torch.ones(1, T, dtype=torch.long), aux, slots))[0]
    next_ids = torch.nn.functional.pad(ids[:, 1:], (0, 1))  # speculators' input_ids[t] is the token slot t reads
    return ours, speculators_logits(model, next_ids, aux, slots, monkeypatch), model


def test_speculators_loads_our_export_and_agrees_on_logits(tiny_target, verifier_folder, tmp_path, monkeypatch):
    head = random_peagle(tiny_target)
    folder = save_speculators_peagle(head, tmp_path / "spec", verifier=str(verifier_folder),
                                     manifest_target=tiny_target.identity(), dtype=torch.float32)
    ours, theirs, model = compare_with_speculators(head, folder, monkeypatch)
    check_speculators_holds_our_head(model, head, PEAGLE_LAYERS)
    assert torch.equal(model.mask_hidden.flatten(), head.mask_hidden.flatten())
    assert torch.equal(model.embed_tokens.weight, head.embed_tokens.weight)
    assert ours.shape == theirs.shape and ours.shape[0] > 16  # deeper slots were compared too
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("a, b", [("layers.1.", "layers.2."), ("layers.0.mlp.gate_proj", "layers.0.mlp.up_proj")])
def test_a_mis_mapped_export_fails_the_check(tiny_target, verifier_folder, tmp_path, monkeypatch, a, b):
    head = random_peagle(tiny_target)
    folder = save_speculators_peagle(head, tmp_path / "spec", verifier=str(verifier_folder),
                                     manifest_target=tiny_target.identity(), dtype=torch.float32)
    tensors = load_file(str(folder / "model.safetensors"))
    swapped = {name.replace(a, "\0").replace(b, a).replace("\0", b): t for name, t in tensors.items()}
    assert set(swapped) == set(tensors)  # same names and shapes: only the mapping is wrong
    save_file(swapped, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ours, theirs, _ = compare_with_speculators(head, folder, monkeypatch)
    assert not torch.allclose(ours, theirs, atol=1e-3, rtol=1e-3)


def test_publish_dry_run_writes_both_formats_and_a_parallel_drafting_card(tiny_target, tmp_path):
    from huggingface_hub import ModelCard

    head_folder = save_peagle(random_peagle(tiny_target), tmp_path / "trained", manifest_target=tiny_target.identity())
    main(["publish", f"head={head_folder}", "repo_id=me/tiny-peagle", f"out={tmp_path / 'hub'}", "dry_run=true",
          "allow_no_eval=true", "formats=[peagle,speculators]", "license=mit", "base_model=a/b"])
    hub = tmp_path / "hub"
    assert json.loads((hub / "config.json").read_text())["parallel_drafting"] is True
    assert json.loads((hub / "speculators" / "config.json").read_text())["speculators_model_type"] == "peagle"
    card = ModelCard.load(hub / "README.md")
    assert "P-EAGLE" in card.text and '"parallel_drafting": true' in card.text
    assert "vLLM ignores the flag in this folder's config.json" in card.text  # the sequential fallback, said
    assert "peagle" in card.data.tags
