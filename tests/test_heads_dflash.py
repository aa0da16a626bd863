"""DFlash folders: the folder vLLM serves with method dflash (names, shapes, dtypes, the config keys vLLM reads,
round trip, refusals), the speculators format, the export CLI, and the outside check: speculators' own
DFlashDraftModel loads our speculators-format export and computes our drafter's logits on the same blocks (a
deliberately mis-mapped export fails that check)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (LLAMA_LAYER_WEIGHTS, check_a_folder_without_embeddings_needs_the_targets,
                     check_cli_export_both_formats, check_speculators_holds_our_head, init_randomly_from_target,
                     layer_weight_names, load_speculators_model, tensors_of)
from safetensors.torch import load_file, save_file

from draftsmith.core import DraftsmithError
from draftsmith.heads.dflash import DFlashHead, block_mask, dflash_config_from_target
from draftsmith.heads.dflash_folders import load_dflash, save_dflash, save_speculators_dflash
from draftsmith.core.methods import method_for_folder
from draftsmith.train.dflash import block_forward

DRAFT_VOCAB = 100
LAYERS = 3
BLOCK = 4


def random_dflash(target, draft_vocab: int = DRAFT_VOCAB, seed: int = 0) -> DFlashHead:
    """A 3-layer drafter initialised from `target`, every other weight random (norms too, so swaps show)."""
    torch.manual_seed(seed)
    head = DFlashHead(dflash_config_from_target(target.model.config, draft_vocab, LAYERS, BLOCK,
                                                target.vocab_size - 1, target.aux_layer_ids))
    return init_randomly_from_target(head, target, draft_vocab, ("fc", "layers", "norm", "hidden_norm"))


def blocks(head, T: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, head.config.vocab_size - 1, (1, T), generator=g)
    aux = torch.randn(1, T, head.fc.in_features, generator=g)
    anchor = torch.tensor([[1, 5, 6, 11]])
    return ids, aux, anchor


@torch.no_grad()
def block_logits(head, T: int = 16, seed: int = 1) -> torch.Tensor:
    """The training layout's logits of four blocks over one random sequence."""
    ids, aux, anchor = blocks(head, T, seed)
    mask = block_mask(anchor, head.block_size, torch.ones(1, T, dtype=torch.bool))
    return head.logits(block_forward(head, ids, aux, anchor, mask))[0].float()


def expected_names(layers: int, d2t: bool = True) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "t2d", "embed_tokens.weight"}
    names |= {"d2t"} if d2t else set()
    return names | layer_weight_names(layers, LLAMA_LAYER_WEIGHTS + ("self_attn.q_norm", "self_attn.k_norm"))


def test_folder_names_shapes_dtypes_and_the_config_vllm_reads(tiny_target, tmp_path):
    head = random_dflash(tiny_target)
    folder = save_dflash(head, tmp_path / "d", manifest_target=tiny_target.identity(), dtype=torch.bfloat16)
    tensors = tensors_of(folder)
    assert set(tensors) == expected_names(LAYERS)
    cfg = head.config
    H, d = cfg.hidden_size, cfg.head_dim
    assert tensors["fc.weight"].shape == (H, 3 * tiny_target.hidden_size) and tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (cfg.num_attention_heads * d, H)  # H-wide input
    assert tensors["layers.2.self_attn.k_proj.weight"].shape == (cfg.num_key_value_heads * d, H)
    assert tensors["layers.1.self_attn.q_norm.weight"].shape == (d,) == tensors["layers.1.self_attn.k_norm.weight"].shape
    assert tensors["lm_head.weight"].shape == (DRAFT_VOCAB, H)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert "mask_hidden" not in tensors  # vLLM asserts DFlash ships none
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == LAYERS and config["layer_types"] == ["full_attention"] * LAYERS
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["vocab_size"] == tiny_target.vocab_size
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "bfloat16"
    assert config["head_dim"] == d and config["attention_bias"] is False
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"]
    aux = tiny_target.aux_layer_ids
    assert config["eagle_aux_hidden_state_layer_ids"] == aux  # HF hidden_states indices, what vLLM reads first
    assert config["dflash_config"] == {"mask_token_id": tiny_target.vocab_size - 1,
                                       "target_layer_ids": [i - 1 for i in aux],  # DFlash's: the output of layer i
                                       "causal": False, "use_aux_hidden_state": True}
    assert config["block_size"] == BLOCK
    assert method_for_folder(folder).name == "dflash"


# vLLM's own config readers (pure functions of a folder's config.json), run in the engine's python on our folders
VLLM_READS = """
import json, sys
from transformers import AutoConfig
from vllm.model_executor.models import qwen3_dflash
from vllm.transformers_utils.configs.speculators import algos, base
plain, spec = sys.argv[1], sys.argv[2]
config = AutoConfig.from_pretrained(plain)
raw = json.load(open(spec + "/config.json"))
translated = {"model_type": "qwen3"}
algos.update_dflash(raw, translated)
print(json.dumps({"config_class": type(config).__name__,
                  "causal": [qwen3_dflash._dflash_layer_causal(config, i) for i in range(config.num_hidden_layers)],
                  "speculative": base.SpeculatorsConfig.extract_vllm_speculative_config(raw),
                  "translated": translated}))
"""


@pytest.mark.slow  # imports vLLM in its own venv (~20 s)
def test_vllm_reads_both_folders_as_non_causal_dflash_with_these_layers(engine_ready, tiny_target, tmp_path):
    """vLLM's own readers on our folders: a Qwen3Config whose every layer is non-causal; the speculators config maps
    to method dflash at K, the target layers in both conventions and causal False (with sliding_window_non_causal
    false, vLLM would make EVERY layer causal)."""
    import subprocess

    from draftsmith.core import engine

    head = random_dflash(tiny_target)
    plain = save_dflash(head, tmp_path / "d")
    spec = save_speculators_dflash(head, tmp_path / "s", verifier="some/target")
    proc = subprocess.run([str(engine_ready), "-c", VLLM_READS, str(plain), str(spec)], capture_output=True, text=True,
                          env=engine.engine_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["config_class"] == "Qwen3Config" and got["causal"] == [False] * LAYERS
    assert got["speculative"] == {"method": "dflash", "num_speculative_tokens": BLOCK - 1}
    out = got["translated"]
    assert out["architectures"] == ["DFlashDraftModel"]
    assert out["eagle_aux_hidden_state_layer_ids"] == tiny_target.aux_layer_ids
    assert out["dflash_config"]["target_layer_ids"] == [i - 1 for i in tiny_target.aux_layer_ids]
    assert out["dflash_config"]["causal"] is False and out["dflash_config"]["mask_token_id"] == head.mask_token_id


def test_round_trip_full_vocab_and_embeddings(tiny_target, tmp_path):
    head = random_dflash(tiny_target)
    back = load_dflash(save_dflash(head, tmp_path / "d"))
    assert len(back.layers) == LAYERS and back.mask_token_id == head.mask_token_id and back.block_size == BLOCK
    assert back.config.aux_layer_ids == tiny_target.aux_layer_ids
    torch.testing.assert_close(block_logits(back), block_logits(head), rtol=0, atol=0)
    # a full-vocab drafter writes no d2t (vLLM has no parameter for it) and reads back the identity map
    full = random_dflash(tiny_target, draft_vocab=tiny_target.vocab_size)
    folder = save_dflash(full, tmp_path / "full")
    assert set(tensors_of(folder)) == expected_names(LAYERS, d2t=False)
    back = load_dflash(folder)
    assert not back.d2t.any()
    torch.testing.assert_close(block_logits(back), block_logits(full), rtol=0, atol=0)
    # without embed_tokens the target's are needed
    check_a_folder_without_embeddings_needs_the_targets(save_dflash, load_dflash, head, tmp_path / "lean", tiny_target,
                                                        block_logits)


def test_bad_folders_are_refused_in_one_sentence(tiny_target, tmp_path):
    folder = save_dflash(random_dflash(tiny_target), tmp_path / "d")
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "layers.1.self_attn.k_norm.weight"},
              str(folder / "model.safetensors"))
    with pytest.raises(DraftsmithError, match="no tensor 'layers.1.self_attn.k_norm.weight'"):
        load_dflash(folder)
    save_file({**tensors, "mask_hidden": torch.zeros(1, 3)}, str(folder / "model.safetensors"))
    with pytest.raises(DraftsmithError, match="unexpected tensor 'mask_hidden'"):
        load_dflash(folder)
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    for edit, message in [({"dflash_config": {"target_layer_ids": [0, 1, 2]}}, "dflash_config.mask_token_id"),
                          ({"eagle_aux_hidden_state_layer_ids": [1, 2]}, "reads 2 target layers"),
                          ({"eagle_aux_hidden_state_layer_ids": "1,2,3"}, "list of integers"),
                          ({"dflash_config": {**config["dflash_config"], "causal": True}}, "causal"),
                          ({"block_size": None}, None)]:
        edited = {**config, **edit}
        if message is None:
            del edited["block_size"]
            message = "no 'block_size'"
        (folder / "config.json").write_text(json.dumps(edited))
        with pytest.raises(DraftsmithError, match=message):
            load_dflash(folder)


def test_cli_export_both_formats(tiny_target, tmp_path, capsys):
    own, config = check_cli_export_both_formats(save_dflash, random_dflash(tiny_target), tiny_target, tmp_path, capsys,
                                                method="dflash", architecture="DFlashSpeculator", layers=LAYERS, k=2)
    assert own["architectures"] == ["DFlashDraftModel"]
    assert config["mask_token_id"] == tiny_target.vocab_size - 1 and config["block_size"] == BLOCK
    assert config["aux_hidden_state_layer_ids"] == tiny_target.aux_layer_ids
    assert config["sliding_window_non_causal"] is True and config["sample_from_anchor"] is False
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    assert set(tensors_of(tmp_path / "s")) == expected_names(LAYERS)


# ---- the outside check: speculators' DFlashDraftModel ------------------------------------------------------

speculators_dflash = pytest.importorskip("speculators.models.dflash")


@torch.no_grad()
def speculators_block_logits(folder, head, monkeypatch, T: int = 16) -> tuple[torch.Tensor, object]:
    """speculators' own training forward on our four blocks (its anchor sampling replaced by ours)."""
    import speculators.models.dflash.core as core

    model = load_speculators_model(speculators_dflash.DFlashSpeculatorConfig, speculators_dflash.DFlashDraftModel,
                                   folder)
    ids, aux, anchor = blocks(head, T)
    model.embed_tokens.weight.copy_(head.embed_tokens.weight)  # speculators never saves them (the verifier's)
    monkeypatch.setattr(core, "select_anchors", lambda loss_mask, n, bs: (anchor[0], torch.ones(n, dtype=torch.bool)))
    _, logits, *_ = model._backbone_forward(hidden_states=aux, input_ids=ids, loss_mask=torch.ones(1, T),
                                            verifier_last_hidden_states=torch.zeros(1, T, model.config.transformer_layer_config.hidden_size),
                                            document_ids=torch.zeros(1, T, dtype=torch.long), max_anchors=anchor.shape[1])
    return logits[0].float(), model


def test_speculators_loads_our_export_and_agrees_on_logits(tiny_target, verifier_folder, tmp_path, monkeypatch):
    head = random_dflash(tiny_target)
    folder = save_speculators_dflash(head, tmp_path / "spec", verifier=str(verifier_folder),
                                     manifest_target=tiny_target.identity(), dtype=torch.float32)
    theirs, model = speculators_block_logits(folder, head, monkeypatch)
    check_speculators_holds_our_head(model, head, LAYERS)
    assert model.block_size == BLOCK and model.target_layer_ids == tiny_target.aux_layer_ids
    ours = block_logits(head)
    assert ours.shape == theirs.shape == (4 * BLOCK, DRAFT_VOCAB)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("a, b", [("layers.1.self_attn.k_norm", "layers.1.self_attn.q_norm"),
                                  ("layers.0.mlp.gate_proj", "layers.0.mlp.up_proj")])
def test_a_mis_mapped_export_fails_the_check(tiny_target, verifier_folder, tmp_path, monkeypatch, a, b):
    head = random_dflash(tiny_target)
    folder = save_speculators_dflash(head, tmp_path / "spec", verifier=str(verifier_folder), dtype=torch.float32)
    tensors = load_file(str(folder / "model.safetensors"))
    wa, wb = a + ".weight", b + ".weight"
    tensors[wa], tensors[wb] = tensors[wb], tensors[wa]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    theirs, _ = speculators_block_logits(folder, head, monkeypatch)
    assert not torch.allclose(block_logits(head), theirs, atol=1e-3, rtol=1e-3)


def test_publish_card_serves_it_with_vllm_method_dflash(tiny_target, tmp_path):
    from draftsmith.publish import PublishConfig, run

    head = save_dflash(random_dflash(tiny_target), tmp_path / "trained", manifest_target=tiny_target.identity())
    result = run(PublishConfig(head=str(head), repo_id="someone/tiny-dflash", base_model="someone/tiny-base",
                               license="apache-2.0", out=str(tmp_path / "hub"), allow_no_eval=True, dry_run=True))
    assert {"config.json", "model.safetensors", "speculators/config.json", "README.md"} <= set(result["files"])
    assert json.loads((tmp_path / "hub" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    text = (tmp_path / "hub" / "README.md").read_text()
    spec = '{"method": "dflash", "model": "someone/tiny-dflash", "num_speculative_tokens": 3}'
    assert f"--speculative-config '{spec}'" in text
    assert "sglang.launch_server" not in text and "serve this head with vLLM" in text
    assert "dflash" in text and "DFlash" in text


def test_beside_a_target_the_folder_must_read_the_layers_it_computes(tiny_target, tmp_path):
    from draftsmith.data_gen.target import TargetConfig, load_target
    from draftsmith.core.methods import methods

    entry = methods()["dflash"]
    assert entry.aux_layer_ids(tiny_target.num_layers) == tiny_target.aux_layer_ids  # what data-gen captures
    folder = save_dflash(random_dflash(tiny_target), tmp_path / "d")
    assert entry.load(folder, tiny_target).config.aux_layer_ids == tiny_target.aux_layer_ids
    other = load_target(TargetConfig(name="tiny", aux_layer_ids=[0, 0, 0], dtype="float32"))
    with pytest.raises(DraftsmithError, match=r"reads target layers .* but the target computes \[0, 0, 0\]"):
        entry.load(folder, other)
