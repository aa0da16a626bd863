"""The speculators peer (benchmarks/peers/speculators_eagle3.py): its converter writes the offline format
speculators' own dataloader reads (names, shapes, loss mask, layer order), and its head adapter computes the
logits speculators' own Eagle3DraftModel computes, EAGLE-3.1 norms on.

Needs `speculators` 0.9 (scripts/setup.sh installs it without its deps); skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("speculators.train.data", reason="speculators 0.9 is not importable in this venv "
                                                    "(scripts/setup.sh installs it with --no-deps)")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from helpers import (assert_ttt_steps_close, eagle3_ttt_logits, load_speculators_model, make_tiny_data,
                     random_ttt_inputs, speculators_eagle3_ttt_logits)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "speculators_eagle3.py"
TTT_STEPS = 3


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("peer_speculators_eagle3", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the method row names its module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture
def tiny_data(tiny_target, tmp_path):
    folder = make_tiny_data(tmp_path / "data", tiny_target, n=7, hidden_states=True)
    # row 5 has no loss-masked token: dropped like draftsmith's training drops it
    import datasets

    ds = datasets.load_from_disk(str(folder / "tokenized"))
    rows = ds.to_dict()
    rows["loss_mask"][5] = [0] * len(rows["loss_mask"][5])
    (folder / "tokenized_tmp").mkdir()
    datasets.Dataset.from_dict(rows, features=ds.features).save_to_disk(str(folder / "tokenized_tmp"))
    import shutil

    shutil.rmtree(folder / "tokenized")
    (folder / "tokenized_tmp").rename(folder / "tokenized")
    return folder


def test_select_rows(peer):
    assert peer.parse_indices("0-3,7,9-10") == [0, 1, 2, 3, 7, 9, 10]
    assert peer.select_rows(10, 4, None, 1) == ([0, 1, 2, 3], [4])
    assert peer.select_rows(10, None, [2, 5], 2) == ([2, 5], [6, 7])
    assert peer.select_rows(10, None, None, 2) == (list(range(8)), [8, 9])
    with pytest.raises(peer.PeerError):
        peer.select_rows(10, 10, None, 1)
    # speculators takes int(rows * ratio) rows for training: exactly the train rows
    for n_train, n in ((16, 17), (1, 2), (999, 1000), (682, 683)):
        assert int(n * peer.train_data_ratio(n_train, n)) == n_train


def test_converter_writes_speculators_offline_format(peer, tiny_data, tiny_target, tmp_path):
    from draftsmith.data_gen.dataset import HiddenStates, load_tokenized
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset

    out = tmp_path / "spec"
    record = peer.convert(tiny_data, out, [0, 1, 2, 5, 3], [4, 6], tiny_target.identity())
    assert record["train_rows"] == [0, 1, 2, 3] and record["val_rows"] == [4, 6] and record["dropped_rows"] == [5]
    assert record["aux_layer_ids"] == tiny_target.aux_layer_ids
    src, _ = load_tokenized(tiny_data)
    hs = HiddenStates(tiny_data)
    H = tiny_target.hidden_size
    rows = [0, 1, 2, 3, 4, 6]

    # the files, by name
    import datasets

    table = datasets.load_from_disk(str(out))
    assert set(table.column_names) == {"input_ids", "loss_mask", "seq_len"}
    assert table.format["type"] == "torch"
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    expected_freq: dict[int, int] = {}
    for j, i in enumerate(rows):
        ids, mask = list(src[i]["input_ids"]), list(src[i]["loss_mask"])
        row = table[j]
        assert row["input_ids"].dtype == torch.long and row["input_ids"].tolist() == ids
        assert row["loss_mask"].dtype == torch.long and row["loss_mask"].tolist() == mask
        assert int(row["seq_len"]) == len(ids)
        path = out / "hidden_states" / f"hs_{j}.safetensors"
        with safe_open(str(path), framework="pt") as f:
            assert set(f.keys()) == {"hidden_states", "token_ids"}
        saved = load_file(path)
        aux, last = hs[i]
        assert saved["hidden_states"].shape == (len(ids), 4, H) and saved["hidden_states"].dtype == aux.dtype
        assert torch.equal(saved["hidden_states"][:, :3].reshape(len(ids), 3 * H), aux)
        assert torch.equal(saved["hidden_states"][:, 3], last)
        assert saved["token_ids"].dtype == torch.long and saved["token_ids"].tolist() == ids
        if j < 4:  # train rows only
            for t, m in zip(ids, mask):
                if m:
                    expected_freq[t] = expected_freq.get(t, 0) + 1
    assert freq == expected_freq
    assert json.loads((out / peer.DATA_MARK).read_text())["num_train"] == 4

    # speculators' own dataloader reads it: its train split is exactly the train rows, features in draftsmith order
    ratio = peer.train_data_ratio(4, 6)
    train = ArrowDataset(max_len=64, datapath=str(out), on_missing="raise", train_ratio=ratio, split="train",
                         hidden_states_dtype=torch.float32)
    val = ArrowDataset(max_len=64, datapath=str(out), on_missing="raise", train_ratio=ratio, split="val",
                       hidden_states_dtype=torch.float32)
    assert len(train) == 4 and len(val) == 2
    for j, i in enumerate(rows[:4]):
        item = train[j]
        aux, last = hs[i]
        assert torch.equal(item["hidden_states"], aux) and torch.equal(item["verifier_last_hidden_states"], last)
        assert item["loss_mask"].tolist() == list(src[i]["loss_mask"])
        shifted = shift_batch(item)  # speculators pairs (token t+1, features of t, target at t+1, mask of t+1)
        assert torch.equal(shifted["hidden_states"], aux[:-1])
        assert shifted["input_ids"].tolist() == list(src[i]["input_ids"])[1:]
        assert shifted["loss_mask"].tolist() == list(src[i]["loss_mask"])[1:]

    # its own output may be replaced; a folder it did not write is refused
    peer.convert(tiny_data, out, [0, 1], [2])
    assert datasets.load_from_disk(str(out)).num_rows == 3
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("mine")
    with pytest.raises(peer.PeerError, match="not empty"):
        peer.convert(tiny_data, other, [0, 1], [2])


# ---- the head: speculators' EAGLE-3.1 norms in draftsmith's decoder -----------------------------------------

def speculators_folder_with_norms(tiny_target, verifier, tmp_path, flags: dict):
    """A speculators EAGLE-3 folder (draftsmith's export of a random head) with norm flags and random norm weights."""
    from helpers import random_head

    from draftsmith.heads.eagle3_folders import save_speculators

    head = random_head(tiny_target)
    folder = save_speculators(head, tmp_path / "spec_head", verifier=str(verifier),
                              manifest_target=tiny_target.identity(), dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    config.update(flags)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    H = tiny_target.hidden_size
    for name in ("layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight", "norm.weight"):
        tensors[name] = 1 + 0.3 * torch.randn(H, generator=g)
    if flags.get("norm_before_fc"):
        tensors["input_norm.weight"] = 1 + 0.3 * torch.randn(3 * H, generator=g)
    if flags.get("fc_norm"):
        for i in range(3):
            tensors[f"fc_norm.{i}.weight"] = 1 + 0.3 * torch.randn(H, generator=g)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def speculators_logits(folder, ids, aux, pos) -> list[torch.Tensor]:
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    model = load_speculators_model(Eagle3SpeculatorConfig, Eagle3DraftModel, folder)
    return speculators_eagle3_ttt_logits(model, ids, aux, pos, TTT_STEPS)


def adapter_logits(head, ids, aux, pos) -> list[torch.Tensor]:
    return eagle3_ttt_logits(head, ids, aux, pos, TTT_STEPS)


RECIPE = {"norm_before_fc": True, "fc_norm": False, "norm_before_residual": True, "norm_output": True}


@pytest.mark.parametrize("flags", [RECIPE, {**RECIPE, "norm_before_fc": False, "fc_norm": True},
                                   {f: False for f in RECIPE}], ids=["recipe", "fc_norm", "plain"])
def test_adapter_computes_speculators_logits(peer, tiny_target, verifier_folder, tmp_path, flags):
    folder = speculators_folder_with_norms(tiny_target, verifier_folder, tmp_path, flags)
    head = peer.load_speculators_folder(folder)
    ids, aux, pos = random_ttt_inputs(tiny_target.vocab_size, 3 * tiny_target.hidden_size, T=11, seed=3, aux_scale=3,
                                      first_position=1)
    theirs = speculators_logits(folder, ids, aux, pos)
    assert_ttt_steps_close(adapter_logits(head, ids, aux, pos), theirs, TTT_STEPS, atol=1e-5, rtol=1e-5)
    if not any(flags.values()):  # draftsmith's own EAGLE-3 folder, converted exactly
        from draftsmith.heads.eagle3_folders import load_eagle3

        plain = load_eagle3(peer.to_eagle3(folder, tmp_path / "eagle3"))
        assert_ttt_steps_close(adapter_logits(plain, ids, aux, pos), theirs, TTT_STEPS, atol=1e-5, rtol=1e-5)
    else:
        with pytest.raises(peer.PeerError, match="norm"):
            peer.to_eagle3(folder, tmp_path / "eagle3")


def test_method_row_claims_speculators_folders(peer, tiny_target, verifier_folder, tmp_path):
    from draftsmith.core.methods import METHODS, method_for_folder

    folder = speculators_folder_with_norms(tiny_target, verifier_folder, tmp_path, RECIPE)
    before = dict(METHODS)
    try:
        peer.register_method()
        entry = method_for_folder(folder)
        assert entry.name == "speculators_eagle3"
        head = entry.load(folder, tiny_target)
        assert head.norm_output and head.norm_before_residual and head.input_norm is not None
        proposer = entry.proposer(head, tiny_target.vocab_size, 64)
        assert proposer.needs_aux
    finally:
        METHODS.clear()
        METHODS.update(before)


def test_adapter_sliding_window_matches_speculators(peer, tiny_target, verifier_folder, tmp_path):
    """A window shorter than the sequence: step 0 (keys at slot = position, as in draftsmith's proposer) agrees."""
    folder = speculators_folder_with_norms(tiny_target, verifier_folder, tmp_path, RECIPE)
    config = json.loads((folder / "config.json").read_text())
    config["transformer_layer_config"].update(layer_types=["sliding_attention"], sliding_window=4,
                                              use_sliding_window=True)
    (folder / "config.json").write_text(json.dumps(config))
    head = peer.load_speculators_folder(folder)
    assert head.sliding_window == 4
    ids, aux, pos = random_ttt_inputs(tiny_target.vocab_size, 3 * tiny_target.hidden_size, T=11, seed=5, aux_scale=3)
    theirs = speculators_logits(folder, ids, aux, pos)[0]
    ours = adapter_logits(head, ids, aux, pos)[0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    head.sliding_window = None  # without the window the logits past it differ: the test sees the window
    assert not torch.allclose(adapter_logits(head, ids, aux, pos)[0][:, 4:], theirs[:, 4:], atol=1e-3)
