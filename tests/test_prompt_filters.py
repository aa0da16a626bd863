"""Quality filters of self-written prompts and regenerated answers (data_gen/filters.py), the task-kind
steering of self-written prompts, and data-gen's hook that applies the filters and counts their drops."""

from __future__ import annotations

import json

import pytest

from draftsmith.core import DraftsmithError
from draftsmith.data_gen.config import FiltersConfig, PromptsConfig
from draftsmith.data_gen.filters import (Deduper, PromptFilter, filter_answers, jaccard, repeated_ngram_ratio,
                                         shingles, text_reason)
from draftsmith.data_gen.prompts import TASK_OPENERS, load_prompts

ON = FiltersConfig(prompts=True, answers=True)
ENGLISH = "Can you help me plan a birthday party for my sister, who loves gardening and old films?"


# --- each filter drops what it should and keeps what it should ---------------------------------

def test_repetition_drops_a_sentence_said_again_and_again():
    looped = "The answer is that the cat sat on the mat. " * 12
    assert repeated_ngram_ratio(looped) > 0.8
    assert text_reason(looped, ON, 1) == "repetition"
    assert repeated_ngram_ratio(ENGLISH) == 0.0
    assert text_reason(ENGLISH, ON, 1) is None
    assert text_reason(looped, FiltersConfig(max_repetition=None), 1) is None  # null = off


def test_length_bounds():
    assert text_reason("Hello there", ON, 3) == "length"
    assert text_reason("Hello there friend", ON, 3) is None
    assert text_reason(ENGLISH, ON, 3, max_words=5) == "length"


@pytest.mark.parametrize("text", [
    "Wie kann ich meinen Garten im Herbst am besten auf den kalten Winter vorbereiten und schützen?",  # German
    "请帮我写一封给老师的感谢信，内容要真诚一些。",  # Chinese
    "\x17V\ufffd\ufffd%#L\ufffd\ufffdx\ufffd",  # undecodable bytes
    "Liam - Bianca - Falderon - Apoliti - Apolito OKSA Monicos Riga Mineira Sulfa Pereglia Patsy",  # names
])
def test_language_drops_other_languages_and_name_salad(text):
    assert text_reason(text, ON, 1) == "language"
    assert text_reason(text, FiltersConfig(language=None), 1) is None


def test_language_keeps_english_with_code_and_short_text():
    answer = ("Here is a function that adds two numbers:\n\n```python\ndef add(a, b):\n    return a + b\n"
              "def sub(a, b):\n    return a - b\n```\n\nYou can call it with two numbers and it returns their sum.")
    assert text_reason(answer, ON, 1) is None  # the code block is neither language nor repetition
    assert text_reason("Paris.", ON, 1) is None  # too short to judge by its words; its letters are Latin
    assert text_reason("Café au lait, s'il vous plaît: is it French?", ON, 1) is None  # accented Latin letters


def test_exact_and_near_duplicates():
    d = Deduper(near_dup=0.7)
    long = "Can you give me a step by step recipe for a vegan chocolate cake with almond flour and maple syrup?"
    assert d.check(long)
    assert not d.check("can you give me a step-by-step recipe for a vegan chocolate cake, with almond flour and maple syrup")
    near = long.replace("maple syrup", "maple sugar")
    assert jaccard(shingles(long), shingles(near)) >= 0.7
    assert not d.check(near)
    assert d.check("Can you give me a recipe for a quick tomato soup?")  # shares a few words only
    exact_only = Deduper(near_dup=None)
    assert exact_only.check(long) and exact_only.check(near) and not exact_only.check(long.upper())


def test_near_dedup_never_drops_a_pair_below_the_threshold():
    texts = [f"Write a short poem about the {w} and the {v} in the early morning light"
             for w in ("sea", "moon", "forest", "city") for v in ("wind", "rain", "birds")]
    d = Deduper(near_dup=0.7)
    kept = []
    for t in texts:
        if d.check(t):
            kept.append(t)
        else:  # a drop is always confirmed by the exact similarity to a kept text
            assert max(jaccard(shingles(t), shingles(k)) for k in kept) >= 0.7
    assert len(kept) >= 1


def test_prompt_filter_counts_each_reason():
    f = PromptFilter(ON)
    assert f.reason(ENGLISH, finished=True) is None
    assert f.reason(ENGLISH, finished=True) == "duplicate"
    assert f.reason("What is the capital city of France and why", finished=False) == "unfinished"
    assert f.reason("Hi", finished=True) == "length"
    assert f.reason("Please tell me. " * 10, finished=True) == "repetition"
    assert f.reason("请帮我写一封给老师的感谢信，内容要真诚一些。谢谢你的帮助。", finished=True) == "language"
    assert f.dropped == {"filtered_prompts_duplicate": 1, "filtered_prompts_unfinished": 1,
                         "filtered_prompts_length": 1, "filtered_prompts_repetition": 1,
                         "filtered_prompts_language": 1}
    assert PromptFilter(FiltersConfig(drop_unfinished=False)).reason("What is the capital city of France", False) is None


def test_filter_answers_drops_a_sample_with_any_bad_turn():
    def sample(*answers):
        msgs = []
        for a in answers:
            msgs += [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": a}]
        return {"id": "x", "category": "", "messages": msgs}

    good = sample("The capital of France is Paris, which is also its largest city.")
    looped = sample("Fine answer here, nothing wrong with it at all.", "I am sorry. " * 30)
    empty = sample("")
    kept, dropped = filter_answers([good, looped, empty], ON)
    assert kept == [good]
    assert dropped == {"filtered_answers_length": 1, "filtered_answers_repetition": 1, "filtered_answers_language": 0}


# --- config: bad values give one sentence ---------------------------------------------------------

@pytest.mark.parametrize("override,message", [
    ("filters.near_dup=2", r"filters\.near_dup=2\.0 must be in \(0, 1\] \(or null for exact only\)\."),
    ("filters.max_repetition=1.5", r"filters\.max_repetition=1\.5 must be in \[0, 1\) \(or null for off\)\."),
    ("filters.language=fr", r"filters\.language=fr is not one of en\."),
    ("filters.min_words=-1", r"filters\.min_words=-1 must be at least 0\."),
    ("filters.max_words=0", r"filters\.max_words=0 must be at least 3 \(or null for no bound\)\."),
    ("filters.repetition_n=0", r"filters\.repetition_n=0 must be at least 1\."),
    ("prompts.kinds=[code,cooking]", r"prompts\.kinds=cooking is not one of code, extraction, "),
    ("prompts.kinds=[]", r"prompts\.kinds=\[\] names no task kind"),
])
def test_bad_filter_and_kind_values_give_one_sentence(compose_cfg, override, message):
    with pytest.raises(DraftsmithError, match=message) as e:
        compose_cfg("data_gen", "target=tiny", override)
    assert "\n" not in str(e.value)


def test_filters_are_off_by_default_and_the_mix_config_composes(compose_cfg):
    cfg = compose_cfg("data_gen", "target=tiny")
    assert cfg.filters.prompts is False and cfg.filters.answers is False and cfg.prompts.kinds is None
    mix = compose_cfg("data_gen", "target=tiny", "prompts=self_mix")
    assert mix.prompts.source == "self" and set(mix.prompts.kinds) <= set(TASK_OPENERS) and len(mix.prompts.kinds) >= 7


# --- self-written prompts: steering and filtering ---------------------------------------------------

def test_kinds_steer_self_prompts_round_robin(tiny_target):
    cfg = PromptsConfig(source="self", n=6, seed=1, max_prompt_tokens=6, kinds=["code", "math", "translation"])
    samples = load_prompts(cfg, tiny_target)
    assert [s["category"] for s in samples] == ["code", "math", "translation"] * 2
    for s in samples:
        text = s["messages"][-1]["content"]
        assert any(text.startswith(o.strip()) for o in TASK_OPENERS[s["category"]]), (s["category"], text)
    assert load_prompts(cfg, tiny_target) == samples  # seeded


def test_unsteered_self_prompts_unchanged_by_the_filter_options(tiny_target):
    cfg = PromptsConfig(source="self", n=4, seed=3, max_prompt_tokens=8)
    plain = load_prompts(cfg, tiny_target)
    assert load_prompts(cfg, tiny_target, FiltersConfig(prompts=False)) == plain  # off: the same prompts
    assert {s["category"] for s in plain} == {"self"}


def test_self_prompt_filters_resample_and_count(tiny_target):
    # the random tiny target writes byte salad: the language check drops every prompt, up to max_attempts
    dropped: dict = {}
    cfg = PromptsConfig(source="self", n=4, seed=0, max_prompt_tokens=8, max_attempts=16)
    with pytest.raises(DraftsmithError, match="is empty"):
        load_prompts(cfg, tiny_target, FiltersConfig(prompts=True, drop_unfinished=False, min_words=0), dropped)
    assert dropped["filtered_prompts_language"] > 0
    assert sum(dropped.values()) == 16  # every attempt was looked at and counted once
    # with the text checks off, only cut-off prompts (all of them at 8 tokens here, or none) are dropped
    kept: dict = {}
    loose = FiltersConfig(prompts=True, language=None, max_repetition=None, min_words=0, near_dup=None)
    samples = load_prompts(PromptsConfig(source="self", n=4, seed=0, max_prompt_tokens=64, max_attempts=16),
                           tiny_target, loose, kept)
    assert kept["filtered_prompts_language"] == kept["filtered_prompts_repetition"] == 0
    assert len(samples) + sum(kept.values()) <= 16


# --- the hook in data-gen: answers filtered, drops counted in the manifest and printed ----------------

QUESTIONS = [{"question_id": i, "category": "qa", "turns": [f"Question number {i}?"]} for i in range(8)]


def test_data_gen_hook_drops_and_counts(compose_cfg, tmp_path, tiny_target):
    from draftsmith.data_gen.dataset import load_conversations
    from draftsmith.data_gen.filters import words
    from draftsmith.data_gen.run import run, summary

    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    # (target.dtype=float32: the default was float32 before auto; these random answers' lengths are for fp32)
    base = ["target=tiny", "target.dtype=float32", "prompts=question", f"prompts.path={path}", "max_new_tokens=12"]
    plain = run(compose_cfg("data_gen", *base, f"out={tmp_path / 'plain'}"))
    assert not any(k.startswith("filtered_") for k in plain["counts"])
    answers = [c["messages"][-1]["content"] for c in load_conversations(tmp_path / "plain")]
    lengths = sorted(len(words(a)) for a in answers)
    bound = lengths[len(lengths) // 2]  # about half the (random) answers are shorter than this
    expect = sum(n < bound for n in lengths)
    assert 0 < expect < len(lengths)

    out = tmp_path / "filtered"
    got = run(compose_cfg("data_gen", *base, f"out={out}", "filters.answers=true", "filters.language=null",
                          "filters.max_repetition=null", f"filters.min_answer_words={bound}"))
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["filtered_answers_length"] == expect
    assert counts["samples"] == plain["counts"]["samples"] - expect
    assert len(load_conversations(out)) == counts["samples"]
    assert f"filters dropped answers {expect} (length {expect})" in summary(got)

    # a rerun with other filter settings re-filters the cached answers (nothing regenerated)
    again = run(compose_cfg("data_gen", *base, f"out={out}", "filters.answers=false"))
    assert again["counts"]["samples"] == plain["counts"]["samples"]
    assert not any(k.startswith("filtered_") for k in again["counts"])


def test_data_gen_hook_counts_prompt_drops(compose_cfg, tmp_path, tiny_target):
    from draftsmith.data_gen.run import run, summary

    out = tmp_path / "self"
    args = ["target=tiny", "prompts=self", "prompts.n=4", "prompts.max_prompt_tokens=6", "max_new_tokens=4",
            f"out={out}", "filters.prompts=true", "filters.language=null", "filters.max_repetition=null",
            "filters.min_words=0", "filters.drop_unfinished=false", "filters.near_dup=0.01"]
    got = run(compose_cfg("data_gen", *args))
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert set(k for k in counts if k.startswith("filtered_prompts_")) == {
        f"filtered_prompts_{r}" for r in ("duplicate", "unfinished", "length", "repetition", "language")}
    saved = json.loads((out / "regenerated" / "self_prompts.json").read_text())
    assert {k: counts[k] for k in saved["filtered"]} == saved["filtered"]
    assert got["counts"] == counts
    total = sum(v for k, v in counts.items() if k.startswith("filtered_prompts_"))
    assert f"filters dropped prompts {total} (" in summary(got)
    # a rerun reuses the saved prompts and their counts
    assert run(compose_cfg("data_gen", *args))["counts"] == counts
