"""Configuration of a Trellis run: typed dataclasses, YAML defaults, OmegaConf merging.

    from trellis.config import load_config
    config = load_config("my_run.yaml", ["actor.optim.lr=1e-5", "rollout.n=8"])
    config.actor.optim.lr            # 1e-05
    config.get("rollout.max_tokens")  # 512 (null in the defaults = data.max_response_length)

The defaults, every key documented, are in ``trellis/config/defaults/trellis.yaml``
(:data:`DEFAULTS_YAML`). This package does not import torch.
"""

from __future__ import annotations

from trellis.config.base import (
    BaseConfig,
    ConfigValueError,
    default_dict,
    field_doc,
    knob,
    schema_default,
    section,
)
from trellis.config.loader import load_config, omega_conf_to_dataclass, to_dict, to_yaml
from trellis.config.needs import RunNeeds, resolve_needs
from trellis.config.render import DEFAULTS_YAML, render_defaults_yaml
from trellis.config.schema import (
    ActorConfig,
    AgentConfig,
    AlgorithmConfig,
    CheckpointEngineConfig,
    CriticConfig,
    DataConfig,
    KLControlConfig,
    LoraConfig,
    ModelConfig,
    OffloadConfig,
    OptimConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    TrainerConfig,
    TrellisConfig,
    ValidationSamplingConfig,
)

__all__ = [
    "DEFAULTS_YAML",
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "BaseConfig",
    "CheckpointEngineConfig",
    "ConfigValueError",
    "CriticConfig",
    "DataConfig",
    "KLControlConfig",
    "LoraConfig",
    "ModelConfig",
    "OffloadConfig",
    "OptimConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunNeeds",
    "TrainerConfig",
    "TrellisConfig",
    "ValidationSamplingConfig",
    "default_dict",
    "field_doc",
    "knob",
    "load_config",
    "omega_conf_to_dataclass",
    "render_defaults_yaml",
    "resolve_needs",
    "schema_default",
    "section",
    "to_dict",
    "to_yaml",
]
