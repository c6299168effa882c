"""The trainer: ``trellis.train(config)`` runs PPO / GRPO (and relatives) end to end.

    import trellis

    result = trellis.train("my_run.yaml", overrides=["trainer.total_training_steps=10"])
    result = trellis.train(config, reward_fn=my_score)   # a Python callable as the reward

``config`` is a ``TrellisConfig`` (from :func:`trellis.load_config`), a path to a YAML file, or a
mapping of the same shape as the YAML.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from trellis.trainer.ppo import Trainer, TrainResult

__all__ = ["TrainResult", "Trainer", "train"]


def train(
    config: Any = None,
    *,
    overrides: Iterable[str] = (),
    reward_fn: Callable[..., Any] | None = None,
) -> TrainResult:
    """Run a training job and return its :class:`TrainResult`.

    Args:
        config: a ``TrellisConfig``, a YAML path, a mapping, or None (defaults + ``overrides``).
        overrides: ``"key=value"`` strings applied on top (as on the command line).
        reward_fn: ``score(data_source, solution_str, ground_truth, extra_info=None)`` used instead of
            ``reward.function`` (it need not be importable by name: the reward runs in this process).
    """
    from trellis.config import load_config
    from trellis.config.schema import TrellisConfig

    overrides = list(overrides)
    if isinstance(config, TrellisConfig):
        if overrides:
            from trellis.config.loader import to_yaml

            config = _load_from_text(to_yaml(config), overrides)
    elif isinstance(config, Mapping):
        import yaml

        config = _load_from_text(yaml.safe_dump(dict(config)), overrides)
    else:
        config = load_config(config, overrides)
    from trellis.hooks import get_plugin_manager

    get_plugin_manager().hook.trellis_config_loaded(config=config)
    return Trainer(config, reward_fn=reward_fn).fit()


def _load_from_text(text: str, overrides: list[str]) -> Any:
    import os
    import tempfile

    from trellis.config import load_config

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    try:
        return load_config(f.name, overrides)
    finally:
        os.unlink(f.name)
