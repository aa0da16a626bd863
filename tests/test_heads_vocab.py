"""The draft vocab map (d2t / t2d) and the head's initialisation from the target."""

from __future__ import annotations

import pytest
import torch

from draftsmith.core import DraftsmithError
from draftsmith.heads.eagle3 import Eagle3Head, eagle3_config_from_target
from draftsmith.heads.vocab import build_vocab_map, count_tokens, draft_vocab_ids


def test_map_invariants_on_random_counts():
    counts = torch.randint(0, 50, (300,), generator=torch.Generator().manual_seed(0))
    d2t, t2d = build_vocab_map(counts, 64)
    assert d2t.dtype == torch.int64 and d2t.shape == (64,)
    assert t2d.dtype == torch.bool and t2d.shape == (300,)
    used = torch.arange(64) + d2t  # target = i + d2t[i]
    assert torch.equal(used, draft_vocab_ids(d2t))
    assert bool((used[1:] > used[:-1]).all()), "draft vocab must be sorted ascending"
    assert int(t2d.sum()) == 64 and bool(t2d[used].all())  # t2d marks exactly the used ids
    assert torch.equal(torch.nonzero(t2d).flatten(), used)


def test_most_frequent_tokens_win_and_ties_keep_lower_ids():
    counts = torch.zeros(20, dtype=torch.long)
    counts[[17, 3, 9, 12]] = torch.tensor([100, 50, 50, 7])
    counts[5] = 7  # ties with 12: the lower id wins
    d2t, t2d = build_vocab_map(counts, 4)
    assert draft_vocab_ids(d2t).tolist() == [3, 5, 9, 17]
    assert torch.nonzero(t2d).flatten().tolist() == [3, 5, 9, 17]


def test_padding_when_few_tokens_were_seen():
    counts = torch.zeros(30, dtype=torch.long)
    counts[[25, 7]] = 3
    d2t, t2d = build_vocab_map(counts, 5)
    # the two seen tokens plus the lowest unseen ids keep the shape the engines expect
    assert draft_vocab_ids(d2t).tolist() == [0, 1, 2, 7, 25]
    assert int(t2d.sum()) == 5


@pytest.mark.parametrize("bad", [0, -1, 31])
def test_bad_draft_vocab_size_is_one_sentence(bad):
    with pytest.raises(DraftsmithError, match="draft_vocab_size"):
        build_vocab_map(torch.ones(30, dtype=torch.long), bad)


def test_count_tokens_counts_only_loss_masked_tokens():
    counts = count_tokens([[1, 2, 2, 3], [2, 4]], [[0, 1, 1, 0], [1, 0]], vocab_size=6)
    assert counts.tolist() == [0, 0, 3, 0, 0, 0]


def test_draft_vocab_never_exceeds_the_target(tiny_target):
    config = eagle3_config_from_target(tiny_target.model.config, 10**6)
    assert config.draft_vocab_size == tiny_target.vocab_size


def test_init_from_target_copies_draft_rows_and_embeddings(tiny_target):
    counts = torch.arange(tiny_target.vocab_size) % 7  # deterministic, uneven
    d2t, t2d = build_vocab_map(counts, 40)
    head = Eagle3Head(eagle3_config_from_target(tiny_target.model.config, 40))
    head.init_from_target(tiny_target.model, d2t, t2d)
    used = draft_vocab_ids(d2t)
    target_lm = tiny_target.model.get_output_embeddings().weight
    assert torch.equal(head.lm_head.weight, target_lm[used])
    assert torch.equal(head.embed_tokens.weight, tiny_target.model.get_input_embeddings().weight)
    assert not head.embed_tokens.weight.requires_grad  # a frozen copy
    assert torch.equal(head.d2t, d2t) and torch.equal(head.t2d, t2d)
    assert torch.equal(head.draft_to_target(torch.arange(40)), used)
