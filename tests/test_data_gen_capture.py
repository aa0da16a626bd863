"""Hidden-state capture: equal to a plain forward, padding-independent, resumable byte for byte."""

from __future__ import annotations

import pytest
import torch

from draftsmith.data_gen import capture as cap
from draftsmith.data_gen.capture import capture_hidden_states, features_batch
from draftsmith.data_gen.dataset import HiddenStates

SEQS = [[(7 * i + j) % 250 for j in range(5 + 3 * i)] for i in range(7)]


def test_features_equal_plain_forward(tiny_target):
    n = tiny_target.num_layers
    for x, feats in zip(SEQS, features_batch(tiny_target, SEQS)):
        aux, last = feats["aux"], feats["last"]
        hs = tiny_target.model(torch.tensor([x]), output_hidden_states=True).hidden_states
        ref = torch.cat([hs[2], hs[n // 2], hs[n - 3]], dim=-1)[0]
        torch.testing.assert_close(aux, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last, hs[n][0], rtol=1e-5, atol=1e-5)
        # last is post-norm: the target's logits come back through lm_head
        logits = tiny_target.model(torch.tensor([x])).logits[0]
        torch.testing.assert_close(tiny_target.logits(last), logits, rtol=1e-4, atol=1e-4)
        # the stored target statistics: its argmax and logsumexp per position
        assert feats["top"].dtype == torch.int32 and torch.equal(feats["top"].long(), logits.argmax(-1))
        torch.testing.assert_close(feats["lse"], torch.logsumexp(logits.float(), -1), rtol=1e-5, atol=1e-5)


def test_right_padding_equals_left_padding(tiny_target):
    right = features_batch(tiny_target, SEQS)
    T = max(map(len, SEQS))
    pad = tiny_target.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (T - len(x)) + x for x in SEQS])
    attn = torch.tensor([[0] * (T - len(x)) + [1] * len(x) for x in SEQS])
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = tiny_target.model.model(input_ids=ids, attention_mask=attn, position_ids=pos, output_hidden_states=True)
    for r, (x, feats) in enumerate(zip(SEQS, right)):
        torch.testing.assert_close(feats["last"], out.hidden_states[-1][r, T - len(x):], rtol=1e-4, atol=1e-4)


def shard_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard_*.safetensors"))}


def test_capture_resume_is_byte_identical(tiny_target, tmp_path, monkeypatch):
    full = tmp_path / "full"
    index = capture_hidden_states(tiny_target, SEQS, full, samples_per_shard=2, batch_size=3)
    assert [e["count"] for e in index["shards"]] == [2, 2, 2, 1] and index["complete"]

    real_write, written = cap._write_shard, []

    def dying_write(path, tensors):
        if len(written) == 2:
            raise KeyboardInterrupt("killed")
        written.append(path.name)
        return real_write(path, tensors)

    part = tmp_path / "part"
    monkeypatch.setattr(cap, "_write_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        capture_hidden_states(tiny_target, SEQS, part, samples_per_shard=2, batch_size=3)
    assert sorted(p.name for p in part.glob("shard_*")) == written == ["shard_00000.safetensors", "shard_00001.safetensors"]
    before = {p: p.stat().st_mtime_ns for p in part.glob("shard_*")}

    recomputed = []
    monkeypatch.setattr(cap, "_write_shard", lambda p, t: recomputed.append(p.name) or real_write(p, t))
    capture_hidden_states(tiny_target, SEQS, part, samples_per_shard=2, batch_size=3)
    assert recomputed == ["shard_00002.safetensors", "shard_00003.safetensors"]
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())  # finished shards kept
    assert shard_bytes(part) == shard_bytes(full)
    assert (part / "index.json").read_text() == (full / "index.json").read_text()


def test_capture_redoes_a_shard_with_wrong_size(tiny_target, tmp_path):
    capture_hidden_states(tiny_target, SEQS, tmp_path, samples_per_shard=4)
    good = shard_bytes(tmp_path)
    (tmp_path / "shard_00001.safetensors").write_bytes(b"truncated")
    capture_hidden_states(tiny_target, SEQS, tmp_path, samples_per_shard=4)
    assert shard_bytes(tmp_path) == good


def test_hidden_states_reader(tiny_target, tmp_path):
    capture_hidden_states(tiny_target, SEQS, tmp_path / "hidden_states", samples_per_shard=3)
    hs = HiddenStates(tmp_path)
    assert len(hs) == len(SEQS)
    H = tiny_target.hidden_size
    assert hs.stats == ("top", "lse")
    for i, (x, ref) in enumerate(zip(SEQS, features_batch(tiny_target, SEQS))):
        aux, last = hs[i]
        assert aux.shape == (len(x), 3 * H) and last.shape == (len(x), H) and aux.dtype == torch.bfloat16
        torch.testing.assert_close(aux.float(), ref["aux"], rtol=1e-2, atol=1e-2)  # bf16 storage
        torch.testing.assert_close(last.float(), ref["last"], rtol=1e-2, atol=1e-2)
        top, lse = hs.target_stats(i)  # stored as computed: int32 and float32, not rounded to bf16
        assert top.dtype == torch.int32 and lse.dtype == torch.float32 and torch.equal(top, ref["top"])
        torch.testing.assert_close(lse, ref["lse"], rtol=1e-6, atol=1e-6)
    with pytest.raises(IndexError):
        hs[len(SEQS)]


def test_capture_redoes_a_corrupt_shard_of_the_right_size(tiny_target, tmp_path):
    capture_hidden_states(tiny_target, SEQS, tmp_path, samples_per_shard=4)
    good = shard_bytes(tmp_path)
    shard = tmp_path / "shard_00000.safetensors"
    shard.write_bytes(b"\x00" * shard.stat().st_size)  # size as indexed, header unreadable
    capture_hidden_states(tiny_target, SEQS, tmp_path, samples_per_shard=4)
    assert shard_bytes(tmp_path) == good
    (tmp_path / "index.json").write_text("{not json")  # a corrupt index: everything recaptured
    capture_hidden_states(tiny_target, SEQS, tmp_path, samples_per_shard=4)
    assert shard_bytes(tmp_path) == good


def test_ranks_capture_their_shards_and_resume_with_another_world_size(tiny_target, tmp_path, monkeypatch):
    full = tmp_path / "full"
    capture_hidden_states(tiny_target, SEQS, full, samples_per_shard=2, batch_size=3)
    folder = tmp_path / "ranks"
    part = capture_hidden_states(tiny_target, SEQS, folder, samples_per_shard=2, batch_size=3, rank=1, world=2)
    assert part["captured"] == [1, 3] and not part["complete"] and not (folder / "index.json").exists()
    assert sorted(p.name for p in folder.glob("index.rank*")) == ["index.rank00001.json"]

    # rank 0 is killed after its first shard
    real_write = cap._write_shard
    monkeypatch.setattr(cap, "_write_shard", lambda p, t: (_ for _ in ()).throw(KeyboardInterrupt("killed"))
                        if p.name == "shard_00002.safetensors" else real_write(p, t))
    with pytest.raises(KeyboardInterrupt):
        capture_hidden_states(tiny_target, SEQS, folder, samples_per_shard=2, batch_size=3, rank=0, world=2)
    header = cap.index_header(tiny_target, "bfloat16", SEQS, 2)
    assert sorted(cap.finished_shards(folder, header)) == [0, 1, 3]

    # a rerun on one process keeps the three finished shards and computes shard 2 alone
    recomputed = []
    monkeypatch.setattr(cap, "_write_shard", lambda p, t: recomputed.append(p.name) or real_write(p, t))
    index = capture_hidden_states(tiny_target, SEQS, folder, samples_per_shard=2, batch_size=3)
    assert recomputed == ["shard_00002.safetensors"] and index["complete"]
    assert shard_bytes(folder) == shard_bytes(full)
    assert (folder / "index.json").read_text() == (full / "index.json").read_text()
    assert not list(folder.glob("index.rank*"))
