"""Every data-gen config option composes against the schema."""

from __future__ import annotations

from pathlib import Path

import pytest

import draftsmith.configs

CONFIGS = Path(draftsmith.configs.__file__).parent


@pytest.mark.parametrize("group", ["prompts", "backend", "target"])
def test_every_option_composes(compose_cfg, group):
    for option in sorted(p.stem for p in (CONFIGS / group).glob("*.yaml")):
        cfg = compose_cfg("data_gen", f"{group}={option}")
        assert getattr(cfg, group) is not None


def test_defaults(compose_cfg):
    cfg = compose_cfg("data_gen")
    assert cfg.target.name == "smollm2" and cfg.prompts.source == "self" and cfg.backend.kind == "hf"
    assert cfg.hidden_states is False and cfg.hidden_states_dtype == "bfloat16"
