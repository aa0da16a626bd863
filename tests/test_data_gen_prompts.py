"""Prompt sources: files, datasets on disk, and prompts written by the target itself."""

from __future__ import annotations

import json

import pytest
from helpers import SPEC_BENCH

from draftsmith.core import DraftsmithError
from draftsmith.data_gen.config import PromptsConfig
from draftsmith.data_gen.prompts import load_prompts, user_header


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sharegpt(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [
        {"id": "a", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q1"},
                                      {"from": "gpt", "value": "A1"}, {"from": "user", "value": "Q2"}]},
        {"conversations": [{"from": "gpt", "value": "only an answer"}]},  # no user turn: skipped
    ])
    [s] = load_prompts(PromptsConfig(source="sharegpt", path=path, n=None))
    assert s["id"] == "a"
    assert [m["role"] for m in s["messages"]] == ["system", "user", "assistant", "user"]
    assert s["messages"][2]["content"] == "A1"


def test_openai_messages_and_n(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(5)]
    samples = load_prompts(PromptsConfig(source="openai", path=write_jsonl(tmp_path / "o.jsonl", rows), n=3))
    assert [s["messages"][0]["content"] for s in samples] == ["q0", "q1", "q2"]
    assert samples[0]["id"] == "o-1"


def test_question_spec_bench_keeps_category_and_id():
    samples = load_prompts(PromptsConfig(source="question", path=SPEC_BENCH, n=None))
    assert len(samples) == 52  # every row of the file
    assert samples[0]["id"] == "81" and samples[0]["category"] == "writing"
    assert [m["role"] for m in samples[0]["messages"]] == ["user", "user"]
    assert len({s["category"] for s in samples}) == 13


def test_hf_dataset_on_disk(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"id": "x", "messages": [{"role": "user", "content": "hello"}]}])
    ds.save_to_disk(str(tmp_path / "ds"))
    [s] = load_prompts(PromptsConfig(source="hf", path=str(tmp_path / "ds"), n=None))
    assert s["id"] == "x" and s["messages"] == [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("line", ['{"turns": ["ok"]', '[1, 2]', '{"no_turns": 1}'])
def test_malformed_line_names_file_and_line(tmp_path, line):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "turns": ["fine"]}\n\n' + line + "\n")
    with pytest.raises(DraftsmithError, match=r"q\.jsonl line 3"):
        load_prompts(PromptsConfig(source="question", path=str(path), n=None))


def test_empty_prompt_set(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DraftsmithError, match="is empty"):
        load_prompts(PromptsConfig(source="question", path=str(tmp_path / "e.jsonl"), n=None))


def test_missing_file():
    with pytest.raises(DraftsmithError, match="no such file"):
        load_prompts(PromptsConfig(source="openai", path="/nonexistent.jsonl"))


def test_user_header(tiny_target):
    assert user_header(tiny_target.tokenizer) == "<|im_start|>user\n"
    assert user_header(tiny_target.tokenizer, "Be brief.") == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"


def test_self_prompts_seeded_unique(tiny_target):
    cfg = PromptsConfig(source="self", n=6, seed=3, max_prompt_tokens=12)
    a = load_prompts(cfg, tiny_target)
    b = load_prompts(cfg, tiny_target)
    assert a == b and len(a) == 6
    texts = [s["messages"][-1]["content"] for s in a]
    assert len(set(texts)) == 6 and all(texts)
    assert load_prompts(PromptsConfig(source="self", n=6, seed=4, max_prompt_tokens=12), tiny_target) != a


def test_self_prompts_give_up_after_max_attempts(tiny_target):
    # greedy sampling writes the same prompt every time: one unique prompt, then the attempts run out
    cfg = PromptsConfig(source="self", n=5, temperature=0.0, max_prompt_tokens=8, max_attempts=10)
    assert len(load_prompts(cfg, tiny_target)) == 1


@pytest.mark.slow
def test_self_prompts_smollm2_header(smollm2_target):
    header = user_header(smollm2_target.tokenizer)
    assert header.endswith("<|im_start|>user\n") and "SmolLM" in header  # the template's default system turn


def test_non_utf8_file_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"turns": ["fine"]}\n{"turns": ["caf\xe9"]}\n')
    with pytest.raises(DraftsmithError, match=r"latin1\.jsonl line 2 is not UTF-8 text") as e:
        load_prompts(PromptsConfig(source="question", path=str(path), n=None))
    assert "\n" not in str(e.value)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes('{"turns": ["fine"]}\n'.encode("utf-8-sig"))  # a byte-order mark is fine
    assert load_prompts(PromptsConfig(source="question", path=str(bom), n=None))[0]["messages"][0]["content"] == "fine"


@pytest.mark.parametrize("source,record", [
    ("openai", {"messages": [{"role": "user", "content": None}]}),
    ("sharegpt", {"conversations": [{"from": "human", "value": None}]}),
    ("openai", {"messages": [{"role": "user", "content": 3}]}),
])
def test_user_turn_without_text_is_refused(tmp_path, source, record):
    path = write_jsonl(tmp_path / "n.jsonl", [{"messages": [{"role": "user", "content": "ok"}]}
                                              if source == "openai" else {"conversations": [{"from": "human", "value": "ok"}]},
                                              record])
    with pytest.raises(DraftsmithError, match=r"n\.jsonl line 2: message 1 \(user\) has content .*, not text"):
        load_prompts(PromptsConfig(source=source, path=path, n=None))


def test_null_assistant_content_and_text_parts(tmp_path):
    path = write_jsonl(tmp_path / "o.jsonl", [{"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]}])  # (an assistant turn is regenerated anyway)
    [s] = load_prompts(PromptsConfig(source="openai", path=path, n=None))
    assert s["messages"] == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]


def test_records_without_user_turn_are_skipped_and_reported(tmp_path, caplog):
    path = write_jsonl(tmp_path / "s.jsonl", [
        {"conversations": [{"from": "gpt", "value": "x"}]},
        {"conversations": [{"from": "human", "value": "q"}]},
        {"conversations": []},
    ])
    assert len(load_prompts(PromptsConfig(source="sharegpt", path=path, n=None))) == 1
    assert f"prompts: skipped 2 record(s) of {path} without a user turn (lines 1, 3)." in caplog.text
