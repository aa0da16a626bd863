"""Resume on another process count: allowed where exact (deepspeed=none, same global batch), else one sentence
saying what to keep equal."""

from pathlib import Path

import pytest

from draftsmith.core import DraftsmithError
from draftsmith.train.checkpoint import check_compatible

BASE = {"method": "eagle3", "target_hash": "t", "micro_batch_size": 1, "train_samples": 64, "total_steps": 10,
        "precision": "fp32", "seed": 0}


def state(deepspeed: str, world: int, grad_accum: int) -> dict:
    compat = {**BASE, "deepspeed": deepspeed, "global_batch": world * grad_accum}
    if deepspeed != "none":
        compat["world_size"] = world
    return {"method": "eagle3", "compat": compat, "layout": {"world_size": world, "grad_accum": grad_accum}}


def now(deepspeed: str, world: int, grad_accum: int) -> tuple[dict, dict]:
    return state(deepspeed, world, grad_accum)["compat"], {"world_size": world, "grad_accum": grad_accum}


def test_plain_torch_moves_to_another_process_count_with_the_same_global_batch():
    compat, layout = now("none", 8, 1)
    check_compatible(state("none", 2, 4), compat, Path("ck"), layout)  # no error


def test_plain_torch_with_another_global_batch_says_which_grad_accum_keeps_it():
    compat, layout = now("none", 4, 4)
    with pytest.raises(DraftsmithError) as e:
        check_compatible(state("none", 2, 4), compat, Path("ck"), layout)
    assert "global batch of 8" in str(e.value) and "set grad_accum=2" in str(e.value)


def test_zero_needs_the_same_process_count():
    compat, layout = now("zero2", 1, 16)
    with pytest.raises(DraftsmithError) as e:
        check_compatible(state("zero2", 16, 1), compat, Path("ck"), layout)
    msg = str(e.value)
    assert "16 processes with deepspeed=zero2" in msg and "= 16 and grad_accum=1" in msg and "\n" not in msg


def test_the_optimizer_must_match_and_older_checkpoints_were_adamw():
    compat, layout = now("none", 1, 1)
    check_compatible(state("none", 1, 1), {**compat, "optimizer": "adamw"}, Path("ck"), layout)  # before optimizer=
    muon = state("none", 1, 1)
    muon["compat"]["optimizer"] = "muon"
    with pytest.raises(DraftsmithError) as e:
        check_compatible(muon, {**compat, "optimizer": "adamw"}, Path("ck"), layout)
    assert str(e.value) == ("ck was written with optimizer='muon'; this run has optimizer='adamw', so it cannot resume "
                            "exactly from it.")
