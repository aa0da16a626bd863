"""DFlash folders: the folder vLLM serves with method dflash (names, shapes, dtypes, the config keys vLLM reads,
round trip, refusals), the speculators format, the export CLI, and the outside check: speculators' own
DFlashDraftModel loads our speculators-format export and computes our drafter's logits on the same blocks (a
deliberately mis-mapped export fails that check)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith.core import DraftsmithError
from draftsmith.cli import main
from draftsmith.heads.dflash import DFlashHead, block_mask, dflash_config_from_target
from draftsmith.heads.dflash_folders import load_dflash, save_dflash, save_speculators_dflash
from draftsmith.heads.vocab import build_vocab_map
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
    head.init_from_target(target.model, *build_vocab_map(torch.randint(0, 1000, (target.vocab_size,)), draft_vocab))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith(("fc", "layers", "norm", "hidden_norm")):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return head


def tensors_of(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


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
    for i in range(layers):
        names |= {f"layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                                                      "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                                      "self_attn.q_norm", "self_attn.k_norm",
                                                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    return names


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
    lean = save_dflash(head, tmp_path / "lean", include_embeddings=False)
    assert "embed_tokens.weight" not in tensors_of(lean)
    with pytest.raises(DraftsmithError, match="embed_tokens"):
        load_dflash(lean)
    back = load_dflash(lean, target_embeddings=tiny_target.model.get_input_embeddings())
    torch.testing.assert_close(block_logits(back), block_logits(head), rtol=0, atol=0)


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
    head_folder = save_dflash(random_dflash(tiny_target), tmp_path / "trained", manifest_target=tiny_target.identity())
    main(["export", f"head={head_folder}", "format=dflash", f"out={tmp_path / 'v'}"])
    assert json.loads((tmp_path / "v" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert tensors_of(tmp_path / "v")["lm_head.weight"].dtype == torch.bfloat16  # export default
    main(["export", f"head={head_folder}", "format=speculators", f"out={tmp_path / 's'}", "num_speculative_tokens=2"])
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["architectures"] == ["DFlashSpeculator"] and config["speculators_model_type"] == "dflash"
    assert config["mask_token_id"] == tiny_target.vocab_size - 1 and config["block_size"] == BLOCK
    assert config["aux_hidden_state_layer_ids"] == tiny_target.aux_layer_ids
    assert config["sliding_window_non_causal"] is True and config["sample_from_anchor"] is False
    assert config["transformer_layer_config"]["num_hidden_layers"] == LAYERS
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    assert config["speculators_config"]["algorithm"] == "dflash"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert set(tensors_of(tmp_path / "s")) == expected_names(LAYERS)
    with pytest.raises(SystemExit):  # the speculators folder is not a head folder draftsmith reads
        main(["export", f"head={tmp_path / 's'}", f"out={tmp_path / 'x'}"])
    assert "speculators format" in capsys.readouterr().err


# ---- the outside check: speculators' DFlashDraftModel ------------------------------------------------------

speculators_dflash = pytest.importorskip("speculators.models.dflash")


@pytest.fixture
def verifier_folder(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "verifier"
    tiny_target.model.save_pretrained(folder)
    return folder


@torch.no_grad()
def speculators_block_logits(folder, head, monkeypatch, T: int = 16) -> tuple[torch.Tensor, object]:
    """speculators' own training forward on our four blocks (its anchor sampling replaced by ours)."""
    import speculators.models.dflash.core as core

    config = speculators_dflash.DFlashSpeculatorConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "sdpa"  # flex attention has no CPU path here
    model = speculators_dflash.DFlashDraftModel.from_pretrained(str(folder), config=config).eval()
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
    assert model.mask_token_id == head.mask_token_id and len(model.layers) == LAYERS
    assert model.block_size == BLOCK and model.target_layer_ids == tiny_target.aux_layer_ids
    assert torch.equal(model.d2t, head.d2t) and torch.equal(model.t2d, head.t2d)
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
    assert entry.target_layer_ids(tiny_target.num_layers) == tiny_target.aux_layer_ids  # what data-gen captures
    folder = save_dflash(random_dflash(tiny_target), tmp_path / "d")
    assert entry.load(folder, tiny_target).config.aux_layer_ids == tiny_target.aux_layer_ids
    other = load_target(TargetConfig(name="tiny", aux_layer_ids=[0, 0, 0], dtype="float32"))
    with pytest.raises(DraftsmithError, match=r"reads target layers .* but the target computes \[0, 0, 0\]"):
        entry.load(folder, other)
