"""The method table: one row per drafting method. Stages look a method up here; none branches on a name.

    train   METHODS[name]: config (configs/method/<name>.yaml) -> new_drafter -> training -> save
    eval    method_for_folder(config.json): load -> proposer (the decoder's interface, eval/proposers/)
    export  method_for_folder(config.json): load -> formats[format]

A method has the same files in each stage; each stage's file ends with its hooks, one typed spec (a frozen dataclass
of draftsmith.core.method_hooks, so a missing hook or a misspelt one is a TypeError where the module builds it, and
mypy checks each hook's type):

    heads/<m>.py                 the drafter (an nn.Module built from the shared kit, heads/kit.py)
    heads/<m>_folders.py         HOOKS = FolderHooks(architectures, formats, load, save, ...): how its folders are
                                 recognised, loaded, saved, exported and published
    train/<m>.py                 HOOKS = TrainingHooks(config, offline_data, new_drafter, training, summarize)
    eval/proposers/<m>.py        proposer(drafter, target_vocab_size, max_len) -> Proposer
    configs/method/<m>.yaml      the options' defaults

The rows are in draftsmith.methods (commands/methods.py, the package root, which registers them when `draftsmith` is
imported, so before any stage asks): each names its hooks with loaders named after the files they read (`folders`,
`proposers`, `train`), functions whose bodies import the module and return its HOOKS (eval/proposers/<m>.py: its
`proposer`), run when a stage first asks for a hook, so `draftsmith eval` never
imports training code and `draftsmith train` never imports eval's; a method defined outside draftsmith registers its
row with `register`. A row without `train` can be evaluated (its folders loaded and drafted with) but not trained.
A row's `engines` (draftsmith.core.engine.Engines) are vLLM's and SGLang's names for the method: eval's recommended
serving settings and publish's card come from them (eval/cost.py `serving_settings`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from . import DraftsmithError
from .engine import Engines
from .method_hooks import FolderHooks, FormatWriter, ProposerBuilder, TrainingHooks


@dataclass(frozen=True)
class Method:
    """One row: the method's name, loaders of its hooks and what the engines call it."""

    name: str
    folders: Callable[[], FolderHooks]  # () -> heads/<m>_folders.py HOOKS
    proposers: Callable[[], ProposerBuilder]  # () -> eval/proposers/<m>.py proposer
    train: Optional[Callable[[], TrainingHooks]] = None  # () -> train/<m>.py HOOKS; None = not trainable
    engines: Engines = Engines(vllm=None)  # vLLM's and SGLang's names for it (eval's report, publish's card)

    def trainable(self) -> TrainingHooks:
        """The training hooks; a method without them cannot be trained (one sentence)."""
        if self.train is None:
            raise DraftsmithError(f"method={self.name!r} cannot be trained; the trainable methods are "
                                  f"{', '.join(trainable())}.")
        return self.train()

    # what the stages read
    @property
    def architectures(self) -> tuple[str, ...]:
        return tuple(self.folders().architectures)

    @property
    def foreign_architectures(self) -> dict[str, str]:
        return dict(self.folders().foreign_architectures)

    @property
    def claims(self) -> Optional[Callable[[dict], bool]]:
        return self.folders().claims

    @property
    def aux_layer_ids(self) -> Optional[Callable[[int], list[int]]]:
        """num_layers -> the target layers the drafter reads (its request to data-gen, train and eval); None: none."""
        return self.folders().aux_layer_ids

    @property
    def engine_warning(self) -> Optional[Callable[[Any, dict], Optional[str]]]:
        """(drafter, the engine job's result) -> one sentence where the engine computes the drafter otherwise than
        its contract, else None; None: the method has no such check."""
        return self.folders().engine_warning

    @property
    def formats(self) -> dict[str, FormatWriter]:
        return dict(self.folders().formats)

    @property
    def unserved_formats(self) -> dict[str, str]:
        """format -> why this method cannot be written in it."""
        return dict(self.folders().unserved_formats)

    def load(self, folder: Path, target: Any = None) -> Any:
        return self.folders().load(folder, target)

    def save(self, drafter: Any, folder: Path, identity: dict) -> Path:
        return self.folders().save(drafter, folder, identity)

    @property
    def card(self) -> Optional[Callable[[dict, list[str], dict], dict]]:
        return self.folders().card

    def proposer(self, drafter: Any, target_vocab_size: int, max_len: int) -> Any:
        return self.proposers()(drafter, target_vocab_size, max_len)

    @property
    def config(self) -> Optional[type]:
        return self.train().config if self.train is not None else None

    @property
    def new_drafter(self) -> Callable:
        return self.trainable().new_drafter

    @property
    def training(self) -> Callable:
        return self.trainable().training

    @property
    def summarize(self) -> Callable:
        return self.trainable().summarize

    @property
    def offline_data(self) -> str:
        return self.train().offline_data if self.train is not None else "hidden_states"


# ---- the table: draftsmith.methods (commands/methods.py) registers the package's rows ------------------------

METHODS: dict[str, Method] = {}


def methods() -> dict[str, Method]:
    """name -> Method."""
    return METHODS


def register(entry: Method) -> None:
    """Add (or replace) a row: a method defined outside draftsmith, or a test's."""
    METHODS[entry.name] = entry


def trainable() -> list[str]:
    return [name for name, m in methods().items() if m.train is not None]


def method_for_config(method_cfg: Any) -> Method:
    """The row whose config dataclass types `method_cfg` (a composed `method` node or a dataclass)."""
    cls = OmegaConf.get_type(method_cfg) if OmegaConf.is_config(method_cfg) else type(method_cfg)
    for entry in methods().values():
        if entry.config is not None and entry.config is cls:
            return entry
    name = cls.__name__ if cls is not None else "untyped"
    raise DraftsmithError(f"method options {name} are not those of a trainable method ({', '.join(trainable())}).")


def read_folder_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise DraftsmithError(f"{path} cannot be read ({e.strerror}).") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftsmithError(f"{path} is not valid JSON ({e}).") from None
    if not isinstance(config, dict):
        raise DraftsmithError(f"{path} is not a model config: it holds no JSON object.")
    return config


def method_for_folder(folder: Path, config: Optional[dict] = None) -> Method:
    """The row whose folders declare this `architectures` (the catch-all row otherwise)."""
    config = read_folder_config(folder) if config is None else config
    arch = (config.get("architectures") or [None])[0]
    catch_all = None
    entries = sorted(methods().values(), key=lambda e: e.claims is None)  # a claim beats the bare architecture
    for entry in entries:
        if arch in entry.foreign_architectures:
            raise DraftsmithError(f"{folder} is in {entry.foreign_architectures[arch]}.")
        if arch in entry.architectures and (entry.claims is None or entry.claims(config)):
            return entry
        if not entry.architectures:
            catch_all = entry
    if catch_all is None:
        raise DraftsmithError(f"{folder} declares architectures {config.get('architectures')!r}, which no "
                              f"draftsmith method reads.")
    return catch_all


def export_formats() -> list[str]:
    return list(dict.fromkeys(fmt for entry in methods().values() for fmt in entry.formats))  # each name once
