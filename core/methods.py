"""The method table: one row per drafting method. Stages look a method up here; none branches on a name.

    train   METHODS[name]: config (configs/method/<name>.yaml) -> new_drafter -> training -> save
    eval    method_for_folder(config.json): load -> proposer (the decoder's interface, eval/proposers/)
    export  method_for_folder(config.json): load -> formats[format]

A method has the same files in each stage, each with the same hooks; its row only names them:

    heads/<m>.py                 the drafter (an nn.Module built from the shared kit, heads/kit.py)
    heads/<m>_folders.py         ARCHITECTURES, load(folder, target) -> drafter, save(drafter, folder, identity),
                                 FORMATS {format: writer(drafter, folder, manifest_target, options) -> Path},
                                 card(options, formats, commands) -> the model card's parts;
                                 optional: claims(config.json) -> bool, FOREIGN_ARCHITECTURES {arch: why not here},
                                 aux_layer_ids(num_layers) -> the target layers whose hidden states it reads
                                 (data-gen captures them, train and eval compute them; absent: it reads none),
                                 engine_warning(drafter, result) -> one sentence or None: where a serving engine's
                                 run (eval engine=vllm: the job's result) computes the drafter otherwise than its
                                 contract (absent: no warning)
    train/<m>.py                 Config (the `method=<m>` options dataclass), new_drafter(target, cfg, train, resume),
                                 training(drafter, target, cfg, mode, autocast) -> (module, prepare),
                                 summarize(stats) -> dict, OFFLINE_DATA (what mode=offline reads)
    eval/proposers/<m>.py        proposer(drafter, target_vocab_size, max_len) -> Proposer
    configs/method/<m>.yaml      the options' defaults

The rows are in draftsmith.methods (commands/methods.py, the package root, which registers them when `draftsmith` is
imported, so before any stage asks): each names its modules with a loader, a function whose body is the import of
the module, run when a stage first asks for a hook, so `draftsmith eval` never imports training code and
`draftsmith train` never imports eval's; a method defined outside draftsmith registers its row with `register`. A row
without `training_module` can be evaluated (its folders loaded and drafted with) but not trained. A row's `engines`
(draftsmith.core.engine.Engines) are vLLM's and SGLang's names for the method: eval's recommended serving settings and
publish's card come from them (eval/cost.py `serving_settings`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional, Protocol

from omegaconf import OmegaConf

from draftsmith.core import DraftsmithError
from draftsmith.core.engine import Engines


# ---- the hooks each module holds ------------------------------------------------------------------------

class Folders(Protocol):
    """heads/<m>_folders.py"""

    ARCHITECTURES: tuple[str, ...]  # config.json `architectures` of its folders; () = any other (the catch-all)
    FORMATS: dict[str, Callable[[Any, Path, Optional[dict], Any], Path]]

    def load(self, folder: Path, target: Any = None) -> Any: ...  # checked against the target when given
    def save(self, drafter: Any, folder: Path, identity: dict) -> Path: ...
    def card(self, options: dict, formats: list[str], commands: dict) -> dict: ...
    # optional: def aux_layer_ids(self, num_layers: int) -> list[int]: ...  (a drafter fed by target features)
    # optional: def engine_warning(self, drafter: Any, result: dict) -> Optional[str]: ...  (vLLM's defects for it)


class Training(Protocol):
    """train/<m>.py"""

    Config: type  # the `method=<m>` options dataclass
    OFFLINE_DATA: str  # what mode=offline reads from a data-gen folder (its manifest key)

    def new_drafter(self, target: Any, cfg: Any, train: Any, resume: Optional[Path]) -> Any: ...
    def training(self, drafter: Any, target: Any, cfg: Any, mode: str, autocast: Callable) -> tuple[Any, Callable]: ...
    def summarize(self, stats: Any) -> dict: ...


class Proposing(Protocol):
    """eval/proposers/<m>.py"""

    def proposer(self, drafter: Any, target_vocab_size: int, max_len: int) -> Any: ...


@dataclass(frozen=True)
class Method:
    """One row: the method's name, loaders of the modules holding its hooks and what the engines call it."""

    name: str
    folders: Callable[[], ModuleType]  # () -> heads/<m>_folders.py
    proposers: Callable[[], ModuleType]  # () -> eval/proposers/<m>.py
    training_module: Optional[Callable[[], ModuleType]] = None  # () -> train/<m>.py; None = not trainable
    engines: Engines = Engines(vllm=None)  # vLLM's and SGLang's names for it (eval's report, publish's card)

    @property
    def heads(self) -> Folders:
        return self.folders()

    @property
    def train(self) -> Optional[Training]:
        return self.training_module() if self.training_module is not None else None

    def trainable(self) -> Training:
        """The training hooks; a method without them cannot be trained (one sentence)."""
        if self.training_module is None:
            raise DraftsmithError(f"method={self.name!r} cannot be trained; the trainable methods are "
                                  f"{', '.join(trainable())}.")
        return self.training_module()

    # what the stages read
    @property
    def architectures(self) -> tuple[str, ...]:
        return tuple(self.heads.ARCHITECTURES)

    @property
    def foreign_architectures(self) -> dict[str, str]:
        return dict(getattr(self.heads, "FOREIGN_ARCHITECTURES", {}))

    @property
    def claims(self) -> Optional[Callable[[dict], bool]]:
        return getattr(self.heads, "claims", None)

    @property
    def aux_layer_ids(self) -> Optional[Callable[[int], list[int]]]:
        """num_layers -> the target layers the drafter reads (its request to data-gen, train and eval); None: none."""
        return getattr(self.heads, "aux_layer_ids", None)

    @property
    def engine_warning(self) -> Optional[Callable[[Any, dict], Optional[str]]]:
        """(drafter, the engine job's result) -> one sentence where the engine computes the drafter otherwise than
        its contract, else None; None: the method has no such check."""
        return getattr(self.heads, "engine_warning", None)

    @property
    def formats(self) -> dict[str, Callable]:
        return self.heads.FORMATS

    @property
    def unserved_formats(self) -> dict[str, str]:
        """format -> why this method cannot be written in it (optional UNSERVED_FORMATS of its folders)."""
        return dict(getattr(self.heads, "UNSERVED_FORMATS", {}))

    def load(self, folder: Path, target: Any = None) -> Any:
        return self.heads.load(folder, target)

    def save(self, drafter: Any, folder: Path, identity: dict) -> Path:
        return self.heads.save(drafter, folder, identity)

    @property
    def card(self) -> Optional[Callable[[dict, list[str], dict], dict]]:
        return getattr(self.heads, "card", None)

    def proposer(self, drafter: Any, target_vocab_size: int, max_len: int) -> Any:
        return self.proposers().proposer(drafter, target_vocab_size, max_len)

    @property
    def config(self) -> Optional[type]:
        return self.train.Config if self.train is not None else None

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
        return self.train.OFFLINE_DATA if self.train is not None else "hidden_states"


# ---- the table: draftsmith.methods (commands/methods.py) registers the package's rows ------------------------

METHODS: dict[str, Method] = {}


def methods() -> dict[str, Method]:
    """name -> Method."""
    return METHODS


def register(entry: Method) -> None:
    """Add (or replace) a row: a method defined outside draftsmith, or a test's."""
    METHODS[entry.name] = entry


def trainable() -> list[str]:
    return [name for name, m in methods().items() if m.training_module is not None]


def method_for_config(method_cfg: Any) -> Method:
    """The row whose config dataclass types `method_cfg` (a composed `method` node or a dataclass)."""
    cls = OmegaConf.get_type(method_cfg) if OmegaConf.is_config(method_cfg) else type(method_cfg)
    for entry in methods().values():
        if entry.config is not None and entry.config is cls:
            return entry
    name = getattr(method_cfg, "name", None)
    raise DraftsmithError(f"method={name!r} is not one of the trainable methods {', '.join(trainable())}.")


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
