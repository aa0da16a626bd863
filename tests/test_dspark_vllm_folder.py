"""DSpark's folder in vLLM, checked without a GPU. vLLM 0.32 serves a DSpark drafter (method dspark) as
`Qwen3DSparkModel` (qwen3_dspark.Qwen3DSparkForCausalLM) on its V2 GPU runner only; the folder it loads is
draftsmith's own (`export format=dspark`): vLLM's SpeculativeConfig maps `DSparkDraftModel` with model_type qwen3 to
`Qwen3DSparkModel` (vllm/config/speculative.py, "DSparkDraftModel" ... model_type == "qwen3").

What vLLM for CPU's own code says of that folder, in the engine's python (one subprocess):
- the speculative config it builds: method dspark, architecture Qwen3DSparkModel, the target layers, the mask token,
  the bonus-anchor layout (sample_from_anchor false), the Markov rank and both heads;
- the weights: its Qwen3DSparkForCausalLM, built on CPU from that config, loads the folder's tensors (read by vLLM's
  own loader) through its own load_weights (its renames, the stacked qkv / gate_up, d2t -> draft_id_to_target_id,
  t2d dropped): no parameter left unloaded but the placeholder vLLM never loads (mask_embedding), no unexpected
  tensor, and the values are ours. The negative controls: a tensor renamed in a copy is refused, and a tensor
  dropped from one (which vLLM itself loads without a word) leaves its parameter unloaded;
- its refusal to decode: vLLM for CPU builds no engine for method dspark (the sentence is asserted below).
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from helpers import edited_copy, randomize_weights

from draftsmith.heads.dspark import DSparkHead, dspark_config_from_target
from draftsmith.heads.dspark_folders import save_dspark
from draftsmith.heads.vocab import build_vocab_map

pytestmark = pytest.mark.slow  # imports vLLM in its own venv (the module ~12 s alone, 2-core AMX Xeon)

BLOCK, RANK, LAYERS, DRAFT_VOCAB = 4, 8, 2, 200
K = BLOCK - 1  # the bonus-anchor block: the anchor and K mask slots
# vLLM for CPU (no Triton CPU backend, so its V1 runner) building an engine with method dspark
REFUSAL = "Model Runner V1 does not support: dspark speculative decoding"  # in pydantic's error for VllmConfig

# In the engine's python: argv = target folder, K, then name=folder pairs; prints one JSON line.
VLLM_LOADS = r"""
import json, math, sys
import torch
from vllm.config import set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.utils.network_utils import get_open_port
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

target, k, folders = sys.argv[1], int(sys.argv[2]), dict(a.split("=", 1) for a in sys.argv[3:])
common = dict(model=target, skip_tokenizer_init=True, dtype="float32", max_model_len=128, enforce_eager=True)


def spec_args(folder, k):
    return EngineArgs(**common, speculative_config={"method": "dspark", "model": folder}
                      | ({"num_speculative_tokens": k} if k else {}))


out = {"folders": {}}
first = next(iter(folders.values()))
try:  # vLLM for CPU asked for an engine that decodes with the drafter
    spec_args(first, k).create_engine_config()
    out["refusal"] = None
except ValueError as e:
    out["refusal"] = str(e)
# the config a GPU's engine holds: the target's, with the speculative config vLLM builds from the folder (the step
# vLLM for CPU refuses above comes after it: the choice of runner)
config = EngineArgs(**common).create_engine_config()
out["default_k"] = spec_args(first, None).create_speculative_config(config.model_config,
                                                                   config.parallel_config).num_speculative_tokens
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
    ensure_model_parallel_initialized(1, 1)
for i, (name, folder) in enumerate(folders.items()):
    spec = spec_args(folder, k).create_speculative_config(config.model_config, config.parallel_config)
    config.speculative_config = spec
    draft = spec.draft_model_config
    hf = draft.hf_config
    got = {"method": spec.method, "architectures": list(draft.architectures),
           "aux_layers": list(get_eagle3_aux_layers_from_config(spec)),
           "mask_token_id": get_parallel_drafting_token_id(hf),
           "sample_from_anchor": getattr(hf, "sample_from_anchor", True), "markov_rank": hf.markov_rank,
           "enable_confidence_head": getattr(hf, "enable_confidence_head", False),
           "confidence_head_with_markov": getattr(hf, "confidence_head_with_markov", False),
           "draft_vocab_size": hf.draft_vocab_size, "num_speculative_tokens": spec.num_speculative_tokens}
    with set_current_vllm_config(config):
        model = initialize_model(config, model_config=draft, prefix=f"draft{i}")
    got["model_class"] = type(model).__name__
    # every parameter poisoned, so one that load_weights leaves alone shows
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(math.nan if p.is_floating_point() else -(2 ** 40))
    weights = get_model_loader(config.load_config).get_all_weights(draft, model)  # vLLM reads the folder's files
    try:
        with set_current_vllm_config(config):
            model.load_weights(weights)
        got["error"] = None
    except Exception as e:
        got["error"] = f"{type(e).__name__}: {e}"
    params = dict(model.named_parameters())
    bad = lambda p: bool(p.isnan().any()) if p.is_floating_point() else bool((p == -(2 ** 40)).any())
    got["unloaded"] = sorted(n for n, p in params.items() if bad(p))
    got["params"] = sorted(params)
    if got["error"] is None:  # the values vLLM holds, to compare with the folder's
        layer0 = model.model.layers[0]
        held = {"fc": model.model.fc.weight, "qkv0": layer0.self_attn.qkv_proj.weight,
                "gate_up0": layer0.mlp.gate_up_proj.weight, "markov_w1": model.model.markov_head.markov_w1.weight,
                "markov_w2": model.model.markov_head.markov_w2.weight, "lm_head": model.lm_head.weight,
                "embed": model.model.embed_tokens.weight}
        if model.model.confidence_head is not None:
            held |= {"conf_w": model.model.confidence_head.proj.weight, "conf_b": model.model.confidence_head.proj.bias}
        if model.draft_id_to_target_id is not None:
            held["d2t"] = model.draft_id_to_target_id
        torch.save({n: t.detach().cpu() for n, t in held.items()}, f"{folder}/vllm-held.pt")
    out["folders"][name] = got
print(json.dumps(out))
"""


def random_dspark(target, draft_vocab: int) -> DSparkHead:
    """A 2-layer drafter of the tiny target, every weight but the copied embeddings random."""
    torch.manual_seed(0)
    head = DSparkHead(dspark_config_from_target(target.model.config, draft_vocab, LAYERS, BLOCK, target.vocab_size - 1,
                                                target.aux_layer_ids, RANK))
    head.init_from_target(target.model, *build_vocab_map(torch.randint(0, 100, (target.vocab_size,)), draft_vocab))
    return randomize_weights(head, ("fc", "layers", "hidden_norm", "norm", "markov_head", "confidence_head"))


def rename(old: str, new: str):
    return lambda state: {(new if name == old else name): t for name, t in state.items()}


@pytest.fixture(scope="module")
def vllm_reads(engine_ready, tiny_target, tmp_path_factory):
    """(folders, what vLLM's code made of each): format=dspark with a reduced draft vocabulary and with the target's
    whole one; the negative controls: the reduced one with markov_w1 renamed, and with one k_norm dropped."""
    from draftsmith.core import engine

    root = tmp_path_factory.mktemp("dspark-vllm")
    target = root / "target"
    tiny_target.model.save_pretrained(target)
    folders = {"dspark": save_dspark(random_dspark(tiny_target, DRAFT_VOCAB), root / "dspark", dtype=torch.float32),
               "dspark_full_vocab": save_dspark(random_dspark(tiny_target, tiny_target.vocab_size), root / "full",
                                                dtype=torch.float32)}
    folders["dspark_markov_w1_renamed"] = edited_copy(folders["dspark"], root / "renamed", tensors=rename(
        "markov_head.markov_w1.weight", "markov_head.markov_embed.weight"))
    folders["dspark_k_norm_dropped"] = edited_copy(folders["dspark"], root / "dropped", tensors=lambda state: {
        name: t for name, t in state.items() if name != "layers.1.self_attn.k_norm.weight"})
    proc = subprocess.run([str(engine_ready), "-c", VLLM_LOADS, str(target), str(K),
                           *(f"{name}={folder}" for name, folder in folders.items())],
                          capture_output=True, text=True, env=engine.engine_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folders, json.loads(proc.stdout.strip().splitlines()[-1])


def folder_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_vllm_reads_the_dspark_folder_as_qwen3_dspark(vllm_reads, tiny_target):
    folders, got = vllm_reads
    for name, vocab in (("dspark", DRAFT_VOCAB), ("dspark_full_vocab", tiny_target.vocab_size)):
        read = got["folders"][name]
        assert read["method"] == "dspark" and read["architectures"] == ["Qwen3DSparkModel"], read
        assert read["model_class"] == "Qwen3DSparkForCausalLM", read
        assert read["aux_layers"] == tiny_target.aux_layer_ids  # HF hidden_states indices, as the target computes
        assert read["mask_token_id"] == tiny_target.vocab_size - 1
        assert read["sample_from_anchor"] is False  # vLLM's default is true: DeepSeek's layout, not ours
        assert read["markov_rank"] == RANK and read["draft_vocab_size"] == vocab
        assert read["enable_confidence_head"] is True and read["confidence_head_with_markov"] is True
        assert read["num_speculative_tokens"] == K
    # left unset, vLLM drafts block_size tokens, one more than the bonus-anchor block holds: serve it with K
    assert got["default_k"] == BLOCK


def test_vllm_loads_every_tensor_of_the_folder_and_holds_our_values(vllm_reads):
    folders, got = vllm_reads
    for name in ("dspark", "dspark_full_vocab"):
        read = got["folders"][name]
        assert read["error"] is None, read["error"]
        # the one parameter vLLM never loads (its placeholder; DSpark masks with the embedding row of the mask token)
        assert read["unloaded"] == ["model.mask_embedding"], read["unloaded"]
        assert ("draft_id_to_target_id" in read["params"]) == (name == "dspark")  # a full-vocab drafter has no d2t
        ours, held = folder_tensors(folders[name]), torch.load(folders[name] / "vllm-held.pt")
        q, k, v = (ours[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
        expected = {"fc": ours["fc.weight"], "qkv0": torch.cat([q, k, v]),
                    "gate_up0": torch.cat([ours["layers.0.mlp.gate_proj.weight"], ours["layers.0.mlp.up_proj.weight"]]),
                    "markov_w1": ours["markov_head.markov_w1.weight"], "markov_w2": ours["markov_head.markov_w2.weight"],
                    "lm_head": ours["lm_head.weight"], "embed": ours["embed_tokens.weight"],
                    "conf_w": ours["confidence_head.proj.weight"], "conf_b": ours["confidence_head.proj.bias"]}
        if "d2t" in ours:
            expected["d2t"] = ours["d2t"]  # offsets (draft id + d2t[id]), vLLM's map_draft_to_target
        assert set(held) == set(expected)
        for key, tensor in expected.items():
            # vLLM's vocabulary-parallel layers (embed_tokens, lm_head, markov_w2) pad their rows with zeros
            padded = held[key]
            assert torch.equal(padded[: len(tensor)], tensor) and not padded[len(tensor):].any(), key


def test_a_renamed_tensor_is_refused_and_a_missing_one_shows(vllm_reads):
    read = vllm_reads[1]["folders"]["dspark_markov_w1_renamed"]
    assert read["error"] is not None and "markov_embed" in read["error"], read
    # vLLM loads a folder without a tensor it expects silently: the poisoned parameter is what shows it
    read = vllm_reads[1]["folders"]["dspark_k_norm_dropped"]
    assert read["error"] is None and read["unloaded"] == ["model.layers.1.self_attn.k_norm.weight",
                                                          "model.mask_embedding"], read


def test_vllm_for_cpu_refuses_to_decode_it(vllm_reads):
    refusal = vllm_reads[1]["refusal"]
    assert refusal is not None and REFUSAL in refusal, refusal
