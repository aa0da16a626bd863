"""Placeholder run() for wiring checks; replaced by the data-generation stage."""
from omegaconf import OmegaConf
from draftsmith.data_gen.target import load_target, TargetConfig


def run(cfg):
    print(OmegaConf.to_yaml(cfg))
    t = load_target(cfg.target)
    print(t.identity())
