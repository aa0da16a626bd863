"""Hydra configs shipped with the package, and the structured schemas they are typed by.

Each stage's schema is a dataclass living beside its code; `register_configs` stores them in
Hydra's ConfigStore as `<stage>_schema`, and `configs/<stage>.yaml` lists it first in its
defaults so every YAML option is type-checked against it.
"""

from __future__ import annotations

import importlib

from hydra.core.config_store import ConfigStore

CONFIG_MODULE = "draftsmith.configs"

# stage config name -> "module:DataclassName"
SCHEMAS = {
    "data_gen": "draftsmith.data_gen.config:DataGenConfig",
    "train": "draftsmith.train.config:TrainConfig",
    "eval": "draftsmith.eval.config:EvalConfig",
    "export": "draftsmith.heads.export:ExportConfig",
    "demo": "draftsmith.eval.demo:DemoConfig",
}


def schema(config_name: str):
    module, _, cls = SCHEMAS[config_name].partition(":")
    return getattr(importlib.import_module(module), cls)


def register_configs(config_name: str) -> None:
    ConfigStore.instance().store(name=f"{config_name}_schema", node=schema(config_name))


def compose(config_name: str, overrides: list[str] | None = None):
    """Compose a stage's config as the CLI would (for tests and programmatic use)."""
    from hydra import compose as hydra_compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_configs(config_name)
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))
