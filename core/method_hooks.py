"""The typed specs of a method's hooks: each method's stage files end with one (heads/<m>_folders.py
`HOOKS = FolderHooks(...)`, train/<m>.py `HOOKS = TrainingHooks(...)`), which its row in the method table
(draftsmith.core.methods) hands to the stages. Frozen dataclasses, so a missing hook or a misspelt one is a TypeError
where the module builds its spec, and mypy checks each hook's type. This module sits apart from the table so that a
method's files declare their hooks without reading the table (tests/test_imports.py: only the stage runners and the
entry points read it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional


# Any where a type is a torch module or a stage's class: the table and these specs import no torch (the CLI reads them)

FormatWriter = Callable[[Any, Path, Optional[dict], Any], Path]  # (drafter, out folder, manifest target, options)
ProposerBuilder = Callable[[Any, int, int], Any]  # (drafter, target_vocab_size, max_len) -> the decoder's Proposer


@dataclass(frozen=True)
class FolderHooks:
    """heads/<m>_folders.py's HOOKS: how the method's folders are recognised, loaded, saved and written."""

    architectures: tuple[str, ...]  # config.json `architectures` of its folders; () = any other (the catch-all)
    formats: Mapping[str, FormatWriter]  # export's format=<name> -> its writer
    load: Callable[[Path, Any], Any]  # (folder, target | None) -> drafter, checked against the target when given
    save: Callable[[Any, Path, dict], Path]  # (drafter, folder, target identity) -> folder
    card: Optional[Callable[[dict, list[str], dict], dict]] = None  # (options, formats, commands) -> the card's parts;
    # None: publish refuses the method's heads
    claims: Optional[Callable[[dict], bool]] = None  # config.json -> ours; None: its architectures alone say so
    foreign_architectures: Mapping[str, str] = field(default_factory=dict)  # architecture -> why it is not read here
    unserved_formats: Mapping[str, str] = field(default_factory=dict)  # another method's format -> why not this one
    # num_layers -> the target layers whose hidden states it reads (data-gen captures them, train and eval compute
    # them); None: it reads none
    aux_layer_ids: Optional[Callable[[int], list[int]]] = None
    # (drafter, an engine job's result) -> one sentence where that serving engine computes the drafter otherwise than
    # its contract (eval engine=vllm), else None; None: the method has no such check
    engine_warning: Optional[Callable[[Any, dict], Optional[str]]] = None


@dataclass(frozen=True)
class TrainingHooks:
    """train/<m>.py's HOOKS: the method's options, its drafter and its training step."""

    config: type  # the `method=<m>` options dataclass (configs/method/<m>.yaml its defaults)
    offline_data: str  # what mode=offline reads from a data-gen folder (its manifest key)
    new_drafter: Callable[[Any, Any, Any, Optional[Path]], Any]  # (target, method options, train data, resume)
    # (drafter, target, method options, mode, autocast) -> (the step module, prepare(batch) -> its keyword arguments)
    training: Callable[[Any, Any, Any, str, Callable], tuple[Any, Callable]]
    summarize: Callable[[Any], dict]  # the summed step statistics -> metrics
