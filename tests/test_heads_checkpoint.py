"""The EAGLE-3 folder vLLM and SGLang load: exact names, shapes, dtypes, config fields, atomic writes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from helpers import DRAFT_VOCAB, EAGLE3_HEAD_TENSORS, logits_of, random_head, random_inputs

from draftsmith.core import DraftsmithError
from draftsmith.heads import folders
from draftsmith.heads.eagle3_folders import load_eagle3, save_eagle3

def test_round_trip_gives_identical_logits(tiny_target, tmp_path):
    head = random_head(tiny_target)
    folder = save_eagle3(head, tmp_path / "head", manifest_target=tiny_target.identity())
    loaded = load_eagle3(folder)
    inputs = random_inputs(head)
    assert torch.equal(logits_of(head, *inputs), logits_of(loaded, *inputs))
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["produced_by"]["stage"] == "train"
    assert manifest["target"]["target_hash"] == tiny_target.target_hash


def test_folder_has_exactly_the_engine_tensors(tiny_target, tmp_path):
    head = random_head(tiny_target)
    folder = save_eagle3(head, tmp_path / "head", dtype=torch.bfloat16)
    H, V, Vd, I = 64, tiny_target.vocab_size, DRAFT_VOCAB, 128
    q, kv = 4 * 16, 2 * 16
    shapes = {
        "fc.weight": (H, 3 * H), "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,), "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H), "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q), "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H), "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (V,), "embed_tokens.weight": (V, H),
    }
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == EAGLE3_HEAD_TENSORS | {"embed_tokens.weight"}
        for name in names:
            t = f.get_tensor(name)
            assert tuple(t.shape) == shapes[name], name
            want = {"d2t": torch.int64, "t2d": torch.bool}.get(name, torch.bfloat16)
            assert t.dtype == want, name
        # vLLM without d2t silently collapses acceptance: it must be there and map to the draft vocab
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    used = torch.arange(Vd) + d2t
    assert torch.equal(torch.nonzero(t2d).flatten(), used)
    assert torch.equal(d2t, head.d2t)


def test_config_json_fields(tiny_target, tmp_path):
    head = random_head(tiny_target)
    folder = save_eagle3(head, tmp_path / "head", manifest_target=tiny_target.identity())
    config = json.loads((folder / "config.json").read_text())
    tc = tiny_target.model.config
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["vocab_size"] == tc.vocab_size
    assert config["tie_word_embeddings"] is False
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "max_position_embeddings"):
        assert config[key] == getattr(tc, key), key
    assert config["rope_theta"] == tc.rope_parameters["rope_theta"]
    assert config["norm_before_residual"] is False
    # default aux layers (2, N//2, N-3) and equal widths: nothing the engines could misread
    assert "target_hidden_size" not in config
    assert not any("aux" in key for key in config) and "eagle_config" not in config


def test_explicit_aux_layer_ids_are_written_for_both_engines(tiny_target, tmp_path):
    identity = {**tiny_target.identity(), "aux_layer_ids": [1, 3, 6]}
    folder = save_eagle3(random_head(tiny_target), tmp_path / "head", manifest_target=identity)
    config = json.loads((folder / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]  # vLLM: HF hidden_states index
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]  # SGLang: layer output


def test_target_hidden_size_only_when_different(tiny_target, tmp_path):
    head = random_head(tiny_target, target_hidden_size=96)
    assert head.fc.weight.shape == (64, 3 * 96)
    folder = save_eagle3(head, tmp_path / "head")
    assert json.loads((folder / "config.json").read_text())["target_hidden_size"] == 96
    loaded = load_eagle3(folder)
    inputs = random_inputs(head)
    assert torch.equal(logits_of(head, *inputs), logits_of(loaded, *inputs))


def test_dropped_embeddings_need_the_targets(tiny_target, tmp_path):
    head = random_head(tiny_target)
    folder = save_eagle3(head, tmp_path / "head", include_embeddings=False)
    assert "embed_tokens.weight" not in load_file(folder / "model.safetensors")
    with pytest.raises(DraftsmithError, match="target_embeddings"):
        load_eagle3(folder)
    loaded = load_eagle3(folder, target_embeddings=tiny_target.model.get_input_embeddings())
    inputs = random_inputs(head)
    assert torch.equal(logits_of(head, *inputs), logits_of(loaded, *inputs))


def test_load_in_bf16_keeps_the_vocab_map_and_fp32_rope(tiny_target, tmp_path):
    folder = save_eagle3(random_head(tiny_target), tmp_path / "head")
    loaded = load_eagle3(folder, dtype=torch.bfloat16)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert loaded.d2t.dtype == torch.int64 and loaded.t2d.dtype == torch.bool
    assert loaded.rotary_emb.inv_freq.dtype == torch.float32


def rewrite_weights(folder, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("d2t"), "has no tensor 'd2t'"),
    (lambda t: t.pop("midlayer.hidden_norm.weight"), "has no tensor 'midlayer.hidden_norm.weight'"),
    (lambda t: t.__setitem__("lm_head.weight", torch.zeros(99, 64)), r"'lm_head.weight' has shape \(99, 64\), expected \(100, 64\)"),
    (lambda t: t.__setitem__("layers.0.mlp.up_proj.weight", torch.zeros(1)), "unexpected tensor 'layers.0.mlp.up_proj.weight'"),
    (lambda t: t.__setitem__("t2d", t["t2d"].long()), "'t2d' is torch.int64, expected torch.bool"),
])
def test_load_refuses_a_broken_folder_with_one_sentence(tiny_target, tmp_path, edit, message):
    folder = save_eagle3(random_head(tiny_target), tmp_path / "head")
    rewrite_weights(folder, edit)
    with pytest.raises(DraftsmithError, match=message) as e:
        load_eagle3(folder)
    assert "\n" not in str(e.value)


def test_load_refuses_a_missing_folder_or_config(tmp_path):
    with pytest.raises(DraftsmithError, match="does not exist"):
        load_eagle3(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DraftsmithError, match="has no config.json"):
        load_eagle3(tmp_path / "empty")


def failing_save(*args, **kwargs):
    path = args[1]
    with open(path, "wb") as f:
        f.write(b"half a file")
    raise OSError("disk full")


def test_crash_mid_save_leaves_nothing_complete_looking(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setattr(folders, "save_file", failing_save)
    with pytest.raises(DraftsmithError, match="disk full"):  # one sentence naming the folder
        save_eagle3(random_head(tiny_target), tmp_path / "head", manifest_target=tiny_target.identity())
    assert list(tmp_path.iterdir()) == []  # neither the folder nor a leftover temporary


def test_crash_mid_save_keeps_the_existing_folder(tiny_target, tmp_path, monkeypatch):
    old = random_head(tiny_target, seed=0)
    folder = save_eagle3(old, tmp_path / "head", manifest_target=tiny_target.identity())
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    monkeypatch.setattr(folders, "save_file", failing_save)
    with pytest.raises(DraftsmithError, match=f"could not write {folder}"):
        save_eagle3(random_head(tiny_target, seed=1), folder, manifest_target=tiny_target.identity())
    assert [p.name for p in tmp_path.iterdir()] == ["head"]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    inputs = random_inputs(old)
    assert torch.equal(logits_of(old, *inputs), logits_of(load_eagle3(folder), *inputs))


def test_save_over_an_existing_folder_replaces_it(tiny_target, tmp_path):
    from draftsmith.core.artifacts import RECORD, write_record

    folder = save_eagle3(random_head(tiny_target, seed=0), tmp_path / "head")
    (folder / "stale.txt").write_text("from an older run")
    write_record(folder)  # (as if that run wrote it: what draftsmith wrote there before goes)
    (folder / "notes.txt").write_text("the user's")  # a file draftsmith did not write stays
    new = random_head(tiny_target, seed=1)
    save_eagle3(new, folder)
    assert sorted(p.name for p in folder.iterdir() if p.name != RECORD) == ["config.json", "model.safetensors",
                                                                            "notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["head"]
    inputs = random_inputs(new)
    assert torch.equal(logits_of(new, *inputs), logits_of(load_eagle3(folder), *inputs))
