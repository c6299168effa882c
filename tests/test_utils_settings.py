"""trellis.utils.settings: config_value and setting over None, mappings, config objects and dataclasses."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import OmegaConf

from trellis.utils.settings import config_value, setting


@dataclass
class _Config:
    lr: float | None = None
    steps: int = 3


def test_config_value_reads_dicts_objects_and_get():
    assert config_value(None, "lr", 1.0) == 1.0
    assert config_value({"lr": 0.5}, "lr", 1.0) == 0.5
    assert config_value({}, "lr", 1.0) == 1.0
    assert config_value(_Config(steps=7), "steps", 0) == 7
    assert config_value(_Config(), "missing", "d") == "d"
    assert config_value(OmegaConf.create({"lr": 0.25}), "lr", 1.0) == 0.25


def test_a_stored_none_is_kept_unless_none_means_default():
    assert config_value({"lr": None}, "lr", 1.0) is None
    assert config_value({"lr": None}, "lr", 1.0, none_is_default=True) == 1.0
    assert setting(_Config(), "lr", 1e-3) == 1e-3
    assert setting(_Config(lr=0.1), "lr", 1e-3) == 0.1
