"""The data-gen stage end to end (tiny target), bad inputs through the CLI, ranks, and the readers."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from draftsmith.core import DraftsmithError
from draftsmith.cli import main
from draftsmith.configs import check_config, compose
from draftsmith.core import artifacts as mf
from draftsmith.data_gen.dataset import HiddenStates, load_conversations, load_tokenized
from draftsmith.data_gen.run import run

QUESTIONS = [{"question_id": 100 + i, "category": "math" if i % 2 else "writing",
              "turns": [f"Question {i}?", "And why?"]} for i in range(5)]


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return str(path)


def base(questions, out, *extra):
    return ["target=tiny", "prompts=question", f"prompts.path={questions}", "max_new_tokens=6",
            f"out={out}", *extra]


def cli_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(["data-gen", *argv])
    assert e.value.code == 2
    return capsys.readouterr().err


def test_run_takes_a_dictconfig_once_checked(tmp_path):
    """run takes the checked, typed tree: a caller in code checks a DictConfig (OmegaConf.structured, Hydra's own)
    once, as the CLI does, and the stage's own check answers (an empty prompt set, read after the target is placed),
    not a TypeError."""
    empty = tmp_path / "q.jsonl"
    empty.write_text("")
    cfg = OmegaConf.structured(compose("data_gen", base(str(empty), tmp_path / "out")))
    with pytest.raises(DraftsmithError, match="is empty"):
        run(check_config("data_gen", cfg))


def test_end_to_end(compose_cfg, questions, tmp_path, tiny_target):
    out = tmp_path / "out"
    summary = run(compose_cfg("data_gen", *base(questions, out, "hidden_states=true", "samples_per_shard=2")))
    counts = summary["counts"]
    assert counts["prompts"] == counts["samples"] == 5 and counts["failed"] == 0
    ds, manifest = load_tokenized(out, tiny_target.identity())
    assert ds.column_names == ["id", "input_ids", "loss_mask"] and ds["id"] == [str(q["question_id"]) for q in QUESTIONS]
    assert ds.features["input_ids"].feature.dtype == "int32" and ds.features["loss_mask"].feature.dtype == "int8"
    assert manifest["counts"]["tokens"] == sum(map(len, ds["input_ids"]))
    assert manifest["counts"]["loss_tokens"] == sum(map(sum, ds["loss_mask"]))
    assert manifest["hidden_states"]["last_hidden_state"] == "post_final_norm"
    conv = load_conversations(out)
    assert conv[0]["category"] == "writing" and [m["role"] for m in conv[0]["messages"]] == ["user", "assistant"] * 2
    hs = HiddenStates(out)
    assert len(hs) == 5 and hs[4][0].shape[0] == len(ds[4]["input_ids"])
    assert "max_new_tokens: 6" in (out / "config.yaml").read_text()
    # target.dtype=auto is resolved before anything is keyed by it: the saved config and the manifest name the dtype
    assert manifest["target_dtype"]["dtype"] in ("float32", "bfloat16") and manifest["target_dtype"]["why"]
    assert f"dtype: {manifest['target_dtype']['dtype']}" in (out / "config.yaml").read_text()
    assert not list(out.glob(".*tmp*"))
    # a rerun with the same config reuses everything and writes the same data
    before = ds["input_ids"]
    assert run(compose_cfg("data_gen", *base(questions, out, "hidden_states=true", "samples_per_shard=2")))["counts"] == counts
    assert load_tokenized(out, None)[0]["input_ids"] == before


def test_ranks_merge_equals_single(compose_cfg, questions, tmp_path, monkeypatch):
    cfg = ["temperature=0.7", "top_p=0.9"]
    run(compose_cfg("data_gen", *base(questions, tmp_path / "single", *cfg)))
    multi = tmp_path / "multi"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    first = run(compose_cfg("data_gen", *base(questions, multi, *cfg)))
    assert not first["merged"] and not (multi / "manifest.json").exists()
    monkeypatch.setenv("RANK", "1")
    assert run(compose_cfg("data_gen", *base(questions, multi, *cfg)))["merged"]
    a, b = load_tokenized(tmp_path / "single")[0], load_tokenized(multi)[0]
    assert a.to_list() == b.to_list()
    assert load_conversations(tmp_path / "single").to_list() == load_conversations(multi).to_list()
    assert json.loads((multi / "manifest.json").read_text())["counts"] == \
        json.loads((tmp_path / "single" / "manifest.json").read_text())["counts"]
    assert not (multi / "parts").exists()


def test_cli_runs(questions, tmp_path, capsys):
    main(["data-gen", *base(questions, tmp_path / "o"), "prompts.n=2"])
    assert "data-gen: 2 samples" in capsys.readouterr().out


def test_cli_malformed_jsonl(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["ok"]}\n{"question_id": 2, "turns": [\n')
    err = cli_error(capsys, ["target=tiny", "prompts=question", f"prompts.path={bad}", f"out={tmp_path / 'o'}"])
    assert "bad.jsonl line 2 is not valid JSON" in err and "Traceback" not in err
    assert not (tmp_path / "o" / "manifest.json").exists() and not (tmp_path / "o" / "tokenized").exists()


def test_no_sample_survives(compose_cfg, questions, tmp_path):
    with pytest.raises(DraftsmithError, match="no sample survived"):
        run(compose_cfg("data_gen", *base(questions, tmp_path / "o", "max_length=8", "on_overflow=drop")))
    assert not (tmp_path / "o" / "tokenized").exists()


def test_cli_empty_prompts(tmp_path, capsys):
    (tmp_path / "e.jsonl").write_text("")
    err = cli_error(capsys, ["target=tiny", "prompts=question", f"prompts.path={tmp_path / 'e.jsonl'}",
                             f"out={tmp_path / 'o'}"])
    assert "is empty" in err


def test_cli_out_of_another_target(questions, tmp_path, capsys, tiny_target):
    out = tmp_path / "o"
    other = {**tiny_target.identity(), "target_id": "other", "target_hash": "0123"}
    mf.write_manifest(out, stage="data_gen", target=other, counts={})
    err = cli_error(capsys, base(questions, out))
    assert "was made for target 'other'" in err
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]  # nothing written


def test_cli_unknown_target(tmp_path, capsys):
    err = cli_error(capsys, ["target=hf", "target.name=./no/such/model", f"out={tmp_path / 'o'}"])
    assert "unknown target" in err


def test_cli_gguf_unsupported_arch(tmp_path, capsys, monkeypatch):
    import gguf
    import numpy as np

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    err = cli_error(capsys, ["target=hf", f"target.name={path}", f"out={tmp_path / 'o'}"])
    assert "architecture 'mamba'" in err


def test_cli_tokenizer_without_chat_template(tmp_path, capsys, tiny_target):
    folder = tmp_path / "nochat"
    tiny_target.model.save_pretrained(folder)
    tok = tiny_target.tokenizer
    saved = tok.chat_template
    tok.chat_template = None
    try:
        tok.save_pretrained(folder)
    finally:
        tok.chat_template = saved
    err = cli_error(capsys, ["target=hf", f"target.name={folder}", "target.dtype=float32", f"out={tmp_path / 'o'}"])
    assert "has no chat template" in err


def test_load_tokenized_refuses(tmp_path, tiny_target):
    with pytest.raises(DraftsmithError, match="no manifest.json"):
        load_tokenized(tmp_path)
    mf.write_manifest(tmp_path, stage="data_gen", target=tiny_target.identity(), counts={"samples": 0})
    with pytest.raises(DraftsmithError, match="is empty"):
        load_tokenized(tmp_path, tiny_target.identity())
    with pytest.raises(DraftsmithError, match="was made for target"):
        load_tokenized(tmp_path, {**tiny_target.identity(), "tokenizer_hash": "x"})
