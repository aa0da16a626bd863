"""Hydra configs shipped with the package, and the structured schemas they are typed by.

Each stage's schema is a dataclass living beside its code; `register_configs` stores them in
Hydra's ConfigStore as `<stage>_schema`, and `configs/<stage>.yaml` lists it first in its
defaults so every YAML option is type-checked against it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import re

from hydra import compose as hydra_compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, ListConfig, MISSING, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from ..core import DraftsmithError
from ..core.methods import methods, trainable

CONFIG_MODULE = "draftsmith.configs"

# stage config name -> "module:DataclassName"
SCHEMAS = {
    "data_gen": "draftsmith.data_gen.config:DataGenConfig",
    "train": "draftsmith.train.config:TrainConfig",
    "eval": "draftsmith.eval.config:EvalConfig",
    "export": "draftsmith.export:ExportConfig",
    "publish": "draftsmith.publish:PublishConfig",
    "demo": "draftsmith.demo:DemoConfig",
}


def schema(config_name: str):
    module, _, cls = SCHEMAS[config_name].partition(":")
    return getattr(importlib.import_module(module), cls)


def register_configs(config_name: str) -> None:
    """Store the stage's schema, and (for a stage with a `method` group: train) every trainable method's options
    as `method/<name>_schema`."""
    store = ConfigStore.instance()
    cls = schema(config_name)
    node = OmegaConf.structured(cls)
    for name in getattr(cls, "CHOSEN_BY_GROUP", ()):
        node[name] = MISSING  # typed by the group option the YAML picks (method=eagle3 -> Eagle3Config)
    store.store(name=f"{config_name}_schema", node=node)
    if "method" not in getattr(cls, "CHOSEN_BY_GROUP", ()):
        return  # a stage without a `method` group (eval, export, ...) never imports a method's training code
    for name, entry in methods().items():
        if entry.config is not None:
            store.store(group="method", name=f"{name}_schema", node=entry.config)


def compose(config_name: str, overrides: list[str] | None = None, *, missing_ok: bool = True):
    """Compose a stage's config as the CLI would (for tests and programmatic use), check it and return the typed
    tree (the stage's schema dataclass, nested dataclasses inside), which the stage's `run` takes.

    A bad override or option value raises DraftsmithError (one sentence). `???` options (a required
    path) may stay unset ('???') unless `missing_ok=False`, as the CLI asks before running a stage."""
    register_configs(config_name)
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        try:
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides or []))
        except Exception as e:  # Hydra / OmegaConf composition errors: one sentence
            raise composition_error(config_name, e) from None
    return check_config(config_name, cfg, missing_ok=missing_ok)


def command_name(config_name: str) -> str:
    return "draftsmith " + config_name.replace("_", "-")


# what a required (`???`) option wants, for the "is required" sentence
REQUIRED_HINTS = {
    "data": "a data-gen output folder",
    "head": "the folder written by draftsmith train",
    "repo_id": "the Hub repo as <owner>/<name>",
}


def method_hint() -> str:
    """What `method= is required` adds: TrainConfig names no method (configs/train.yaml picks the default), so a
    config built in code without one is refused here, never trained with a method it did not name."""
    return (f"one of {', '.join(trainable())} (`draftsmith train method=<name>`; in code, TrainConfig(method=...) with "
            f"that method's options dataclass, draftsmith.train.<name>.HOOKS.config)")


def check_config(config_name: str, cfg, *, missing_ok: bool = False):
    """Refuse a stage config with one sentence (DraftsmithError) before any work is done; return it typed.

    Checks that every key is an option of the stage's schema (a `+key=value` typo is not silently
    kept), that required (`???`) options are set unless `missing_ok`, and builds the schema
    dataclasses from the values so that their `__post_init__` range checks run. What comes back is that
    tree: a new object (the stage's schema dataclass), so a stage that resolves `auto` never touches the caller's."""
    if not OmegaConf.is_config(cfg):
        cfg = OmegaConf.structured(cfg)
    cls = schema(config_name)
    check_keys(config_name, cfg, cls)
    if not missing_ok:
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            key = missing[0]
            hint = method_hint() if key == "method" else REQUIRED_HINTS.get(key, "it has no default")
            raise DraftsmithError(f"{key}= is required: {hint}.")
    assert isinstance(cfg, DictConfig)
    built = _instantiate(cls, cfg)
    if not missing_ok:
        _check_required(built)
    return built


def _check_required(obj) -> None:
    """Run `check_required()` of every nested config dataclass: options that must be set before a run
    (a prompt file for prompts=sharegpt, ...) but that a group option cannot mark `???`, since a YAML
    `???` does not override a schema default."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_required(value)
    if hasattr(obj, "check_required"):
        obj.check_required()


def _instantiate(cls, node):
    """cls(**node), nested dataclasses first, so every `__post_init__` runs; `???` values pass as '???'."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name not in node:
            continue
        if OmegaConf.is_missing(node, f.name):
            kwargs[f.name] = "???"
            continue
        value = node[f.name]
        if isinstance(value, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(value)):
            value = _instantiate(OmegaConf.get_type(value), value)
        elif isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        kwargs[f.name] = value
    return cls(**kwargs)


def _options(cls, prefix: str = "") -> list[str]:
    """Every option of a schema dataclass, nested ones dotted; a field a group option types (CHOSEN_BY_GROUP: the
    `method` of train) lists the options of every trainable method's Config."""
    names = []
    for f in dataclasses.fields(cls):
        names.append(prefix + f.name)
        if f.name in getattr(cls, "CHOSEN_BY_GROUP", ()):
            subs = [methods()[name].config for name in trainable()]
        else:
            sub = _field_dataclass(cls, f.name)
            subs = [sub] if sub is not None else []
        for sub in subs:
            names += _options(sub, prefix + f.name + ".")
    return list(dict.fromkeys(names))  # each option once


def _field_dataclass(cls, name: str):
    """The dataclass type of field `name` of `cls`, or None."""
    node = OmegaConf.structured(cls)
    child = node._get_node(name)
    t = OmegaConf.get_type(child) if child is not None else None
    return t if t is not None and dataclasses.is_dataclass(t) else None


# (stage, old option) -> its name now: a user's old command line gets a pointer, not a guess
RENAMED = {("export", "speculative_tokens"): "num_speculative_tokens",
           ("publish", "speculative_tokens"): "num_speculative_tokens"}


def unknown_option(config_name: str, key: str):
    """DraftsmithError: `key` is no option of the stage, with the closest option as a suggestion."""
    if (config_name, key) in RENAMED:
        return DraftsmithError(f"option {key} of {command_name(config_name)} is now {RENAMED[config_name, key]} "
                               f"(the name every stage and vLLM use for K, the number of drafted tokens).")
    options = _options(schema(config_name))
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
    if not close:  # a typo in the last part of a dotted key
        parent, _, last = key.rpartition(".")
        siblings = [o.rpartition(".")[2] for o in options if o.rpartition(".")[0] == parent]
        close = [f"{parent}.{m}" if parent else m for m in difflib.get_close_matches(last, siblings, n=1)]
    hint = f"did you mean {close[0]}?" if close else f"`{command_name(config_name)} --help` lists the options."
    return DraftsmithError(f"unknown option {key} for {command_name(config_name)}; {hint}")


def check_keys(config_name: str, cfg, cls, prefix: str = "") -> None:
    """Every key of the composed config must be a field of its schema dataclass (recursively)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in cfg.keys():
        if key not in fields:
            raise unknown_option(config_name, prefix + str(key))
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            sub = OmegaConf.get_type(child)
            if sub is not None and dataclasses.is_dataclass(sub):
                check_keys(config_name, child, sub, f"{prefix}{key}.")


def composition_error(config_name: str, e: Exception):
    """One sentence (DraftsmithError) for a Hydra / OmegaConf error raised while composing overrides."""
    chain: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and x not in chain:
        chain.append(x)
        x = x.__cause__ or x.__context__
    for x in chain:
        if isinstance(x, DraftsmithError):
            return x
        missing_file = getattr(x, "missing_cfg_file", None)
        if missing_file:
            group, _, option = str(missing_file).rpartition("/")
            options = [o for o in getattr(x, "options", None) or [] if not o.endswith("_schema")]  # not the typing nodes
            if group and options:
                return DraftsmithError(f"{group}={option} is not an option of {command_name(config_name)}; "
                                       f"choose from {', '.join(options)}.")
            return DraftsmithError(f"{missing_file} is not a config of {command_name(config_name)}.")
    for x in chain:
        key = getattr(x, "full_key", None)  # (OmegaConf sets it where it raises: not on every exception of its kinds)
        if not isinstance(x, OmegaConfBaseException) or not key:
            continue
        if isinstance(x, (ConfigKeyError, ConfigAttributeError)):
            return unknown_option(config_name, key)
        if isinstance(x, ValidationError):
            msg = str(getattr(x, "msg", "") or x).splitlines()[0]
            m = re.search(r"could not be converted to (\w+)|is not a valid (\w+)", msg)
            if m:
                kind = {"Integer": "integer", "Float": "number", "bool": "boolean (true or false)"}.get(
                    m.group(1) or m.group(2), (m.group(1) or m.group(2)).lower())
                return DraftsmithError(f"{key}={x.value} is not a valid {kind}.")
            return DraftsmithError(f"{key}: {msg.rstrip('.')}.")
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    return DraftsmithError(f"{first.rstrip('.')}.")
