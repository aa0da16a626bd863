"""What a method's row and files declare, read by every stage (issue 21): the engines' names for it (eval's
recommendation, publish's card), one name and one default for K, P-EAGLE's trained depth saved in its folder and
enforced by eval, and the target layers a drafter reads (data-gen captures exactly those)."""

from __future__ import annotations

import json
import types

import datasets
import pytest
import torch
from safetensors import safe_open
from helpers import random_peagle

from draftsmith.core import DraftsmithError, methods
from draftsmith.cli import main
from draftsmith.configs import compose
from draftsmith.data_gen.target import TargetConfig, load_target
from draftsmith.core.engine import NUM_SPECULATIVE_TOKENS, Engines
from draftsmith.core.method_hooks import FolderHooks
from draftsmith.eval.cost import serving_settings
from draftsmith.eval.decoder import DraftingConfig
from draftsmith.eval.proposers.peagle import proposer as peagle_proposer
from draftsmith.core.layers import default_aux_layer_ids
from draftsmith.heads.peagle_folders import load_peagle, save_peagle
from draftsmith.core.sampling import SamplingConfig


# --------------------------------------------------------------------------- engines: from the row, no name branch

def test_serving_settings_come_from_the_rows_engines_alone():
    engines = Engines(vllm="made_up", vllm_options=(("extra_key", 7),))
    s = serving_settings("any-name", engines, "org/target", "heads/x", 4)
    assert s["vllm"]["config"] == {"method": "made_up", "model": "heads/x", "num_speculative_tokens": 4,
                                   "extra_key": 7}
    assert s["sglang"]["command"] is None and "any-name" in s["sglang"]["note"]
    s = serving_settings("other", Engines(vllm=None, sglang="ALGO"), "org/target", "heads/x", 2)
    assert s["vllm"]["config"] is None and s["sglang"]["flags"]["--speculative-algorithm"] == "ALGO"
    assert s["sglang"]["flags"]["--speculative-draft-model-path"] == "heads/x"


def test_every_row_says_what_the_engines_call_it():
    rows = methods.methods()
    assert rows["eagle3"].engines == Engines(vllm="eagle3", sglang="EAGLE3", llamacpp="draft-eagle3")
    assert rows["peagle"].engines.vllm == "eagle3" and dict(rows["peagle"].engines.vllm_options) == {
        "parallel_drafting": True} and rows["peagle"].engines.sglang is None
    assert rows["draft"].engines == Engines(vllm="draft_model", sglang="STANDALONE", llamacpp="draft-simple")
    assert rows["peagle"].engines.llamacpp is None  # llama.cpp has no P-EAGLE graph
    assert rows["dflash"].engines == Engines(vllm="dflash", llamacpp="draft-dflash")
    assert rows["dspark"].engines == Engines(vllm="dspark", llamacpp="draft-dspark")  # vLLM: on a GPU only
    # MTP: vLLM serves the stitched target folder itself, with no draft model in its speculative config
    mtp = serving_settings("mtp", rows["mtp"].engines, "org/target", "runs/stitched", 3)["vllm"]
    assert mtp["config"] == {"method": "mtp", "num_speculative_tokens": 3}
    assert mtp["command"] == "vllm serve runs/stitched --speculative-config '{\"method\": \"mtp\", " \
                             "\"num_speculative_tokens\": 3}'"
    x = FolderHooks(architectures=("X",), formats={}, load=lambda folder, target: None,
                    save=lambda drafter, folder, identity: folder)
    row = methods.Method("x", folders=lambda: x, proposers=lambda: lambda drafter, vocab_size, max_len: None)
    assert row.engines.vllm is None  # serves nowhere by default


# --------------------------------------------------------------------------- K: one name, one default

def test_k_has_one_default_in_every_stage():
    assert NUM_SPECULATIVE_TOKENS == 3
    assert compose("eval", ["head=ngram"]).drafting.num_speculative_tokens == NUM_SPECULATIVE_TOKENS
    assert compose("export", ["head=h"]).num_speculative_tokens == NUM_SPECULATIVE_TOKENS
    assert compose("demo", []).num_speculative_tokens == NUM_SPECULATIVE_TOKENS
    assert compose("publish", ["head=h", "repo_id=a/b"]).num_speculative_tokens is None  # the report's K, else the default
    assert DraftingConfig().num_speculative_tokens == NUM_SPECULATIVE_TOKENS


@pytest.mark.parametrize("stage,args", [("export", ["export", "head=h"]), ("publish", ["publish", "head=h", "repo_id=a/b"])])
def test_the_old_k_option_points_at_its_new_name(stage, args, capsys):
    with pytest.raises(SystemExit) as e:
        main([*args, "speculative_tokens=4"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"draftsmith {stage}: error: option speculative_tokens of draftsmith {stage} is now "
                   f"num_speculative_tokens (the name every stage and vLLM use for K, the number of drafted tokens).")


# --------------------------------------------------------------------------- P-EAGLE: its trained depth

def test_peagle_folder_saves_its_depths_and_eval_refuses_more(tiny_target, tmp_path):
    head = random_peagle(tiny_target)
    head.config.num_depths = 2
    folder = save_peagle(head, tmp_path / "p")
    assert json.loads((folder / "config.json").read_text())["num_depths"] == 2
    loaded = load_peagle(folder)
    assert loaded.config.num_depths == 2
    prop = peagle_proposer(loaded, tiny_target.vocab_size, 64)
    with pytest.raises(DraftsmithError, match=r"K=3 .* more than the 2 depths this P-EAGLE head was trained for"):
        prop.propose(DraftingConfig(num_speculative_tokens=3), SamplingConfig(temperature=0.0))


def test_peagle_folder_without_depths_is_not_bounded_and_a_bad_one_is_refused(tiny_target, tmp_path):
    head = random_peagle(tiny_target)
    folder = save_peagle(head, tmp_path / "p")  # num_depths None: a folder another tool wrote
    config = json.loads((folder / "config.json").read_text())
    assert "num_depths" not in config and load_peagle(folder).config.num_depths is None
    (folder / "config.json").write_text(json.dumps({**config, "num_depths": 0}))
    with pytest.raises(DraftsmithError, match="num_depths=0; it must be a positive integer"):
        load_peagle(folder)


def test_training_a_peagle_head_records_method_depths(tiny_target):
    from draftsmith.train.peagle import PEagleConfig, new_peagle

    rows = types.SimpleNamespace(indices=[0], input_ids=[[1, 2, 3, 4]], loss_mask=[[0, 1, 1, 1]])
    head = new_peagle(tiny_target, PEagleConfig(draft_vocab_size=64, num_layers=1, depths=5), rows, None)
    assert head.config.num_depths == 5


# --------------------------------------------------------------------------- the layers a method asks for

@pytest.fixture
def layer_probe_method():
    """A row whose folders' hooks ask for target layers [0, N] (registered from outside the package)."""
    hooks = FolderHooks(architectures=("LayerProbe",), formats={}, load=lambda folder, target: None,
                        save=lambda drafter, folder, identity: folder, aux_layer_ids=lambda num_layers: [0, num_layers])
    methods.register(methods.Method("layerprobe", folders=lambda: hooks,
                                    proposers=lambda: lambda drafter, vocab_size, max_len: None))
    yield hooks
    del methods.methods()["layerprobe"]


def test_load_target_takes_the_methods_request_unless_the_user_set_layers(layer_probe_method):
    n = load_target(TargetConfig(name="tiny", dtype="float32")).num_layers
    assert load_target(TargetConfig(name="tiny", dtype="float32"), layers=layer_probe_method.aux_layer_ids).aux_layer_ids == [0, n]
    assert load_target(TargetConfig(name="tiny", dtype="float32")).aux_layer_ids == default_aux_layer_ids(n)
    assert load_target(TargetConfig(name="tiny", aux_layer_ids=[1], dtype="float32"),
                       layers=layer_probe_method.aux_layer_ids).aux_layer_ids == [1]


def test_data_gen_captures_the_layers_hidden_states_for_asks_for(layer_probe_method, tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": "math", "turns": [f"Q {i}?"]}) + "\n"
                         for i in range(3)))
    out = tmp_path / "data"
    main(["data-gen", "target=tiny", "target.dtype=float32", "prompts=question", f"prompts.path={q}",
          "max_new_tokens=4", "hidden_states=true", "hidden_states_dtype=float32", "hidden_states_for=layerprobe",
          f"out={out}"])
    target = load_target(TargetConfig(name="tiny", dtype="float32"), layers=layer_probe_method.aux_layer_ids)
    index = json.loads((out / "hidden_states" / "index.json").read_text())
    assert index["aux_layer_ids"] == [0, target.num_layers]
    with safe_open(str(out / "hidden_states" / index["shards"][0]["file"]), "pt") as f:
        aux = f.get_tensor("0.aux")
    assert aux.shape[-1] == 2 * target.hidden_size
    # the stored features are the request's layers, in its order (layer 0: the embeddings' output)
    ids = datasets.load_from_disk(str(out / "tokenized"))["input_ids"][0]
    want, _ = target.features(torch.tensor([ids]))
    torch.testing.assert_close(aux, want[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("override,says", [
    ("hidden_states_for=draft", "hidden_states_for='draft': hidden states are captured for a method that reads them"),
    ("hidden_states_for=bogus", "hidden_states_for='bogus'"),
    ("hidden_states_source=bogus", "hidden_states_source='bogus' is not one of hf"),
])
def test_bad_feature_options_are_one_sentence(override, says, tmp_path, capsys):
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "math", "turns": ["Q?"]}) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["data-gen", "target=tiny", "prompts=question", f"prompts.path={q}", "hidden_states=true", override,
              f"out={tmp_path / 'o'}"])
    assert e.value.code == 2 and says in capsys.readouterr().err
