"""Shared helpers for the component tests: configs without a Hydra compose per case."""

from __future__ import annotations

import copy
import dataclasses
from functools import lru_cache
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from stabletrain.config import (
    AttentionConfig,
    DeescConfig,
    InitConfig,
    NormConfig,
    ReparamConfig,
    TrainConfig,
    register,
)
from stabletrain.registry import option_value

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs")


def compose_cfg(*overrides: str):
    """A composed DictConfig, as train.py would build it."""
    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("train", overrides=list(overrides))


@lru_cache(maxsize=None)
def _base(model: str) -> TrainConfig:
    return OmegaConf.to_object(compose_cfg(f"model={model}"))


def make_cfg(model: str = "gpt_test", *, norm: dict | None = None, attention: dict | None = None,
             reparam: dict | None = None, init: dict | None = None, deescalate: dict | None = None,
             regularizer: dict | None = None, **model_keys) -> TrainConfig:
    """The composed config of ``model`` (a plain dataclass) with component groups replaced.

    Each group dict gives the fields that differ from the schema defaults, e.g.
    ``norm=dict(name="stablenorm", alpha=0.25)``. Composed once per model, then copied.
    """
    cfg = copy.copy(_base(model))
    cfg.model = dataclasses.replace(cfg.model, **model_keys)
    for key, cls, given in (("norm", NormConfig, norm), ("attention", AttentionConfig, attention),
                            ("reparam", ReparamConfig, reparam), ("init", InitConfig, init),
                            ("deescalate", DeescConfig, deescalate)):
        if given is not None:
            setattr(cfg, key, cls(**given))
    if regularizer is not None:  # loss term name -> its parameters
        cfg.regularizer = regularizer
    return cfg


def model_input(cfg, batch: int = 2, tokens: int | None = None, seed: int = 0):
    """A tiny input for ``cfg.model``: token ids for GPT, images otherwise."""
    g = torch.Generator().manual_seed(seed)
    m = cfg.model
    if option_value(m.family) == "gpt":
        return torch.randint(0, m.vocab_size, (batch, tokens or m.block_size), generator=g)
    return torch.randn(batch, m.in_chans, m.img_size, m.img_size, generator=g)
