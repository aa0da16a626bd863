"""Eval prompt readers: every format, per-category sampling, malformed lines named by file and line."""

import json

import pytest
from helpers import SPEC_BENCH

from draftsmith.core import DraftsmithError
from draftsmith.eval.config import EvalPromptsConfig
from draftsmith.eval.prompts import load_prompts, read_jsonl, render, sample


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_question_format(tmp_path):
    p = write(tmp_path / "q.jsonl", [
        {"question_id": 1, "category": "writing", "turns": ["a", "b"]},
        "",
        {"question_id": 2, "category": "math", "turns": ["c"]},
    ])
    prompts = read_jsonl(p, "question")
    assert [(x.id, x.category, x.turns) for x in prompts] == [("1", "writing", ["a", "b"]), ("2", "math", ["c"])]


def test_sharegpt_and_openai_keep_user_turns(tmp_path):
    sg = write(tmp_path / "sg.jsonl", [{"id": "x", "conversations": [
        {"from": "system", "value": "be brief"}, {"from": "human", "value": "q1"},
        {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"}]}])
    oa = write(tmp_path / "oa.jsonl", [{"messages": [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}])
    [s] = read_jsonl(sg, "sharegpt")
    assert (s.id, s.turns, s.system) == ("x", ["q1", "q2"], "be brief")
    [o] = read_jsonl(oa, "openai")
    assert o.turns == ["hello"] and o.system is None


@pytest.mark.parametrize("source,line,needle", [
    ("question", '{"question_id": 1, "turns": ["ok"]}\n{"question_id": 2, "turns": "oops"}', "line 2"),
    ("question", '{"turns": ["ok"]}\n\n{not json', "line 3"),
    ("sharegpt", '{"conversations": [{"from": "gpt", "value": "only an answer"}]}', "line 1"),
    ("openai", '{"messages": [{"role": "user"}]}', "line 1"),
])
def test_malformed_line_names_file_and_line(tmp_path, source, line, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(DraftsmithError) as e:
        read_jsonl(p, source)
    assert str(p) in str(e.value) and needle in str(e.value)
    assert "\n" not in str(e.value)


def test_spec_bench_per_category_sampling():
    prompts = read_jsonl(SPEC_BENCH, "question")
    assert len(prompts) == 52  # 4 of each of 13 categories
    picked = sample(prompts, per_category=2, seed=0)
    cats = [p.category for p in picked]
    assert len(picked) == 26 and all(cats.count(c) == 2 for c in set(cats)) and len(set(cats)) == 13
    assert picked == sample(prompts, per_category=2, seed=0)  # seeded
    assert picked != sample(prompts, per_category=2, seed=1)
    assert len(sample(prompts, per_category=2, n=5, seed=0)) == 5
    assert {p.category for p in sample(prompts, categories=["math", "qa"])} == {"math", "qa"}
    with pytest.raises(DraftsmithError, match="categories"):
        sample(prompts, categories=["nope"])


def test_load_prompts_multi_turn_and_errors():
    cfg = EvalPromptsConfig(source="question", path=SPEC_BENCH, n=None, categories=["writing"])
    assert all(len(p.turns) == 1 for p in load_prompts(cfg))
    cfg.multi_turn = True
    assert all(len(p.turns) == 2 for p in load_prompts(cfg))
    with pytest.raises(DraftsmithError, match="holdout"):
        load_prompts(EvalPromptsConfig(source="self", path=SPEC_BENCH))
    with pytest.raises(DraftsmithError, match="prompts.path"):
        load_prompts(EvalPromptsConfig(source="question", path=None))


def test_holdout_reads_last_rows_of_data_gen_conversations(tmp_path):
    import datasets

    rows = [{"id": f"s{i}", "category": "self", "messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(10)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "conversations"))
    cfg = EvalPromptsConfig(source="holdout", path=str(tmp_path), holdout=3, n=None)
    assert [(p.id, p.turns) for p in load_prompts(cfg)] == [("s7", ["q7"]), ("s8", ["q8"]), ("s9", ["q9"])]
    cfg.holdout = 10
    with pytest.raises(DraftsmithError, match="holdout"):
        load_prompts(cfg)
    # with a tokenized set: the conversations of its last rows (train's val_samples), matched by id
    tok = [{"id": f"s{i}", "input_ids": [1, 2], "loss_mask": [0, 1]} for i in range(10) if i != 8]
    datasets.Dataset.from_list(tok).save_to_disk(str(tmp_path / "tokenized"))
    cfg.holdout = 2
    assert [p.id for p in load_prompts(cfg)] == ["s7", "s9"]


def test_render_conditions_on_previous_answers():
    from draftsmith.data_gen.target import tiny_tokenizer

    tok = tiny_tokenizer()
    from draftsmith.eval.prompts import EvalPrompt

    p = EvalPrompt("1", "c", ["first", "second"])
    text = tok.decode(render(tok, p, ["my answer"]))
    assert text.index("first") < text.index("my answer") < text.index("second")
    assert text.endswith("<|im_start|>assistant\n")


def test_same_record_rules_as_data_gen(tmp_path, caplog):
    """Records without a user turn: skipped and reported, as data-gen does; null / non-UTF-8: one sentence."""
    p = write(tmp_path / "s.jsonl", [{"conversations": [{"from": "gpt", "value": "x"}]},
                                     {"conversations": [{"from": "human", "value": "q"}]}])
    assert [x.turns for x in read_jsonl(p, "sharegpt")] == [["q"]]
    assert "skipped 1 record(s) of" in caplog.text
    p = write(tmp_path / "n.jsonl", ['{"messages": [{"role": "user", "content": null}]}'])
    with pytest.raises(DraftsmithError, match=r"n\.jsonl line 1: message 1 \(user\) has content null"):
        read_jsonl(p, "openai")
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(b'{"turns": ["\xe9"]}\n')
    with pytest.raises(DraftsmithError, match=r"latin1\.jsonl line 1 is not UTF-8 text"):
        read_jsonl(p, "question")
