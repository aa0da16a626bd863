"""A method's hooks are fields of a typed spec (draftsmith.core.method_hooks, issue 50 item 2): a missing or misspelt
hook fails when the spec is built, not when a stage first reads it; the table reads hooks as fields, never by name."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from draftsmith.core import methods
from draftsmith.core.method_hooks import FolderHooks, TrainingHooks

ROOT = Path(__file__).resolve().parents[1]


def folder_hooks(**hooks) -> FolderHooks:
    return FolderHooks(architectures=("Spec",), formats={}, load=lambda folder, target: None,
                       save=lambda drafter, folder, identity: folder, **hooks)


def test_a_misspelt_hook_fails_when_the_spec_is_built():
    # the peer's old spelling of aux_layer_ids, which no stage read
    with pytest.raises(TypeError, match="target_layer_ids"):
        folder_hooks(target_layer_ids=lambda num_layers: [0, num_layers])
    with pytest.raises(TypeError, match="summarise"):
        TrainingHooks(config=object, offline_data="hidden_states", new_drafter=print, training=print, summarise=print)


def test_a_missing_hook_fails_when_the_spec_is_built():
    with pytest.raises(TypeError, match="save"):
        FolderHooks(architectures=("Spec",), formats={}, load=lambda folder, target: None)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="summarize"):
        TrainingHooks(config=object, offline_data="hidden_states", new_drafter=print,  # type: ignore[call-arg]
                      training=print)


def test_a_spec_is_frozen_and_its_optional_hooks_default_to_none_or_empty():
    hooks = folder_hooks()
    assert hooks.claims is hooks.card is hooks.aux_layer_ids is hooks.engine_warning is None
    assert hooks.foreign_architectures == {} and hooks.unserved_formats == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        hooks.aux_layer_ids = lambda num_layers: [num_layers]  # type: ignore[misc]


def test_every_row_builds_its_specs():
    """Each package row's loaders return the typed specs (the proposer: a function)."""
    for name, row in methods.methods().items():
        assert isinstance(row.folders(), FolderHooks), name
        assert callable(row.proposers()), name
        if row.train is not None:
            assert isinstance(row.trainable(), TrainingHooks), name
            assert dataclasses.is_dataclass(row.config), name


def test_the_table_reads_no_hook_by_name():
    """0 getattr hook reads and 0 `type: ignore` in the method table (core/methods.py, core/method_hooks.py) and its
    rows (commands/methods.py)."""
    for path in ("core/methods.py", "core/method_hooks.py", "commands/methods.py"):
        text = (ROOT / path).read_text()
        assert not re.findall(r"\b(getattr|hasattr)\(", text), path
        assert "type: ignore" not in text, path
