"""MTP layers (issue 48): the layer computes what vLLM 0.32's MiMoMTP computes (checked against transformers' own
Qwen2 decoder layer), its tensors are read from and stitched into the target's safetensors, and a Llama / Qwen2 target
is saved as a MiMo with a fresh layer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding
from helpers import TINY_LLAMA_VOCAB, causal_mask, random_layers, tiny_llama

from draftsmith.core import DraftsmithError
from draftsmith.heads import mtp_folders
from draftsmith.heads.mtp import MTPDrafter, init_mtp_layer, mtp_config_from_target

def tiny_mimo(folder, seed: int = 0, drafter=None):
    """A tiny random Llama saved as a MiMo (its MTP layer random too); (folder, the Llama)."""
    model = tiny_llama(seed)
    drafter = drafter or random_layers(mtp_config_from_target(model.config), seed + 1)
    return mtp_folders.save_as_mimo(model, folder, drafter), model


def vllm_reference(drafter: MTPDrafter, qwen2_config, embeds, hidden, positions):
    """MiMoMultiTokenPredictorLayer.forward (vLLM 0.32 mimo_mtp.py) written with transformers' Qwen2 modules."""
    layer = drafter.layers[0]
    block = Qwen2DecoderLayer(qwen2_config, 0).eval()
    block.load_state_dict({k: v for k, v in layer.state_dict().items()
                           if k.startswith(("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm."))})
    norm = lambda w: Qwen2RMSNorm(w.numel(), eps=qwen2_config.rms_norm_eps)  # noqa: E731
    token_norm, hidden_norm, final = norm(layer.token_layernorm.weight), norm(layer.hidden_layernorm.weight), norm(
        layer.final_layernorm.weight)
    with torch.no_grad():
        token_norm.weight.copy_(layer.token_layernorm.weight)
        hidden_norm.weight.copy_(layer.hidden_layernorm.weight)
        final.weight.copy_(layer.final_layernorm.weight)
        embeds = torch.where(positions[..., None] == 0, 0, embeds)
        x = layer.input_proj(torch.cat([hidden_norm(hidden), token_norm(embeds)], dim=-1))
        T = x.shape[1]
        pos_emb = Qwen2RotaryEmbedding(qwen2_config)(x, positions)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = block(x, attention_mask=mask, position_embeddings=pos_emb, position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        return final(out)


def test_the_layer_computes_what_vllm_mimo_mtp_computes():
    model = tiny_llama()
    config = mtp_config_from_target(model.config)
    drafter = random_layers(config).attach(model)
    qwen2 = Qwen2Config(**{k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                           "num_attention_heads", "num_key_value_heads",
                                                           "rms_norm_eps", "max_position_embeddings")},
                        num_hidden_layers=1, attn_implementation="eager")
    ids = torch.randint(0, TINY_LLAMA_VOCAB, (1, 7))
    hidden = torch.randn(1, 7, 64) * 3
    positions = torch.arange(7)[None]
    with torch.no_grad():
        out, logits = drafter(ids, hidden, positions, causal_mask(7))
    ref = vllm_reference(drafter, qwen2, model.get_input_embeddings()(ids), hidden, positions)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, model.lm_head(ref), atol=1e-5, rtol=1e-5)
    # negative control: the fusion order swapped is another function
    config.mtp_fusion = "embedding_first"
    swapped = MTPDrafter(config).attach(model)
    swapped.load_state_dict(drafter.state_dict())
    with torch.no_grad():
        assert not torch.allclose(swapped(ids, hidden, positions, causal_mask(7))[0], ref, atol=1e-3)


def test_the_pre_norm_state_is_read_from_hidden_states_n():
    """MiMo's layer reads the last layer's output before the final norm; it is recovered from hidden_states[N]."""
    model = tiny_llama()
    drafter = random_layers(mtp_config_from_target(model.config)).attach(model)
    ids = torch.randint(0, TINY_LLAMA_VOCAB, (1, 6))
    with torch.no_grad():
        captured = {}
        hook = model.model.norm.register_forward_pre_hook(lambda m, args: captured.update(pre=args[0]))
        post = model.model(ids, output_hidden_states=True).hidden_states[-1]
        hook.remove()
        positions = torch.arange(6)[None]
        from_post = drafter(ids, drafter.engine_hidden(post), positions, causal_mask(6))[0]
        from_pre = drafter(ids, captured["pre"], positions, causal_mask(6))[0]
        torch.testing.assert_close(from_post, from_pre, atol=1e-5, rtol=1e-5)
        drafter.config.mtp_hidden = "post_norm"  # the other state: another input (the final norm is not all ones)
        assert not torch.allclose(drafter(ids, drafter.engine_hidden(post), positions, causal_mask(6))[0], from_pre,
                                  atol=1e-3)
        drafter.config.mtp_hidden = "pre_norm"
        model.model.norm.weight[3] = 0.0  # the pre-norm state cannot be read back through a zero weight
        with pytest.raises(DraftsmithError, match="final norm has a zero weight"):
            drafter.attach(model)


def test_save_as_mimo_loads_in_transformers_and_in_draftsmith(tmp_path):
    folder, llama = tiny_mimo(tmp_path / "mimo")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["MiMoForCausalLM"] and config["num_nextn_predict_layers"] == 1
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is False
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert torch.count_nonzero(f.get_tensor("model.layers.0.self_attn.q_proj.bias")) == 0  # a Llama's: zero
    assert {n for n in names if n.startswith("model.mtp_layers.")} == set(mtp_folders.mtp_shapes(
        mtp_config_from_target(llama.config)))
    qwen2 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # drops the MTP tensors
    assert isinstance(qwen2, Qwen2ForCausalLM)
    ids = torch.randint(0, TINY_LLAMA_VOCAB, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(qwen2(ids).logits, llama(ids).logits, atol=1e-5, rtol=1e-5)  # the same target
    drafter = mtp_folders.load_mtp(folder)
    assert drafter.config.mtp_hidden == "pre_norm" and drafter.config.mtp_fusion == "hidden_first"
    assert not any(p.requires_grad for p in drafter.parameters())


def test_stitch_changes_only_the_mtp_tensors_and_checks_shapes(tmp_path):
    folder, llama = tiny_mimo(tmp_path / "mimo")
    (folder / "tokenizer.json").write_text("{}")  # a target file the stitch carries over
    trained = random_layers(mtp_config_from_target(llama.config), seed=7)
    out = mtp_folders.stitch(trained, folder, tmp_path / "stitched", dtype=torch.float32)
    assert json.loads((out / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    assert (out / "tokenizer.json").read_text() == "{}"
    with safe_open(str(folder / "model.safetensors"), "pt") as a, safe_open(str(out / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        changed = {n for n in a.keys() if not torch.equal(a.get_tensor(n), b.get_tensor(n))}
    assert changed and all(n.startswith("model.mtp_layers.0.") for n in changed)
    loaded = mtp_folders.load_mtp(out)
    for k, v in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    # a layer of another width is refused, naming the tensor; nothing is written
    other = random_layers(mtp_config_from_target(tiny_llama(hidden=32).config))
    with pytest.raises(DraftsmithError, match=r"model\.mtp_layers\.0\..*has shape"):
        mtp_folders.stitch(other, folder, tmp_path / "wrong")
    assert not (tmp_path / "wrong").exists()
    # never over a folder the stage did not write
    (tmp_path / "users").mkdir()
    (tmp_path / "users" / "notes.txt").write_text("mine")
    with pytest.raises(DraftsmithError):
        mtp_folders.stitch(trained, folder, tmp_path / "users")
    assert (tmp_path / "users" / "notes.txt").read_text() == "mine"


def test_stitch_into_a_sharded_target(tmp_path):
    """A target in two shards with an index: the MTP tensors leave the shards that held them for the first one, the
    index names every tensor's file, and the other tensors are unchanged."""
    folder, llama = tiny_mimo(tmp_path / "mimo")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    names = sorted(tensors)
    half = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in half.items():
        save_file({n: tensors[n] for n in part}, str(folder / file), metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    (folder / mtp_folders.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {
        n: file for file, part in half.items() for n in part}}))
    trained = random_layers(mtp_config_from_target(llama.config), seed=9)
    out = mtp_folders.stitch(trained, folder, tmp_path / "stitched")
    index = json.loads((out / mtp_folders.INDEX).read_text())["weight_map"]
    assert set(index) == set(names) and set(index.values()) == set(half)
    loaded = mtp_folders.load_mtp(out)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.state_dict().items())
    back = mtp_folders.read_tensors(out, lambda n: ".mtp_layers." not in n)
    assert all(torch.equal(back[n], tensors[n]) for n in back) and len(back) == len(names) - len(
        mtp_folders.mtp_shapes(trained.config))


def test_a_llama_folder_is_converted_with_a_grafted_layer(tmp_path):
    llama = tiny_llama()
    llama.save_pretrained(tmp_path / "llama")
    drafter = MTPDrafter(mtp_config_from_target(llama.config))
    init_mtp_layer(drafter.layers[0], generator=torch.Generator().manual_seed(0))
    out = mtp_folders.stitch(drafter, tmp_path / "llama", tmp_path / "mimo", dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MiMoForCausalLM"]
    qwen2 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, TINY_LLAMA_VOCAB, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(qwen2(ids).logits, llama(ids).logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(mtp_folders.load_mtp(out).layers[0].input_proj.weight, drafter.layers[0].input_proj.weight)


def test_a_folder_with_a_wrong_or_missing_mtp_tensor_is_refused(tmp_path):
    folder, _ = tiny_mimo(tmp_path / "mimo")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    with pytest.raises(DraftsmithError, match=r"has no tensor 'model\.mtp_layers\.1\.token_layernorm\.weight'"):
        mtp_folders.load_mtp(folder)
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(DraftsmithError, match=r"mlp\.gate_proj\.weight' has shape \(128, 64\), expected \(64, 64\)"):
        mtp_folders.load_mtp(folder)
