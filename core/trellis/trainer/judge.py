"""The colocated judge: a rollout replica of ``reward.model.path`` in the trainer's process, served
on loopback by the Trellis gateway so that the reward managers reach it over HTTP like any judge.

``reward.model`` with ``kind: generative`` and ``placement: colocated``: :func:`start_judge` builds the
replica (``reward.model.replica`` from ``trellis.rollout_replicas``, as the trainer builds its own),
starts a gateway in front of it on ``127.0.0.1`` and writes the gateway's address into
``reward.model.base_url`` for the run's reward managers (driver or workers) to read;
:meth:`RunningJudge.stop` stops both and clears the address again. External judges and classifiers
need nothing started here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from trellis.config.base import ConfigValueError

logger = logging.getLogger(__name__)


def needs_judge(config: Any) -> bool:
    """Whether the run serves its own judge: ``reward.model`` generative, colocated, with a path."""
    model = getattr(config.reward, "model", None)
    return (
        model is not None
        and model.kind == "generative"
        and model.placement == "colocated"
        and model.path is not None
    )


def _judge_device(config: Any) -> str | None:
    """The device the judge replica loads on: the run's device (None = the replica's choice, the CPU)."""
    from trellis.device import get_device_backend

    backend = get_device_backend(config.trainer.device)
    if backend.device_type == "cpu":
        return None
    return f"{backend.device_type}:{backend.current_device()}"


@dataclass
class RunningJudge:
    """A judge replica behind a gateway, started by :func:`start_judge`.

    Attributes:
        base_url: the gateway's OpenAI-compatible API root (``http://127.0.0.1:PORT/v1``).
        replica: the rollout replica serving ``reward.model.path``.
        gateway: the running gateway (``trellis.rollout.gateway.RunningGateway``).
    """

    base_url: str
    replica: Any
    gateway: Any
    config: Any

    def stop(self) -> None:
        """Stop the replica and the gateway, and clear ``reward.model.base_url`` again."""
        try:
            shutdown = getattr(self.replica, "shutdown", None)
            if shutdown is not None:
                self.gateway.call(shutdown())
        finally:
            self.gateway.stop()
            if self.config.reward.model.base_url == self.base_url:
                self.config.reward.model.base_url = None


def start_judge(config: Any) -> RunningJudge | None:
    """Serve ``reward.model.path`` on loopback when the run's judge is colocated (else None).

    On return ``config.reward.model.base_url`` holds the gateway's address; the run's reward managers,
    built after this, send their requests there. Call :meth:`RunningJudge.stop` when the run ends.

    Raises:
        ConfigValueError: ``reward.placement=workers`` on several machines: their workers cannot reach
            the driver's loopback address.
        UnknownComponentError: ``reward.model.replica`` names no rollout replica.
    """
    if not needs_judge(config):
        return None
    model = config.reward.model
    if config.reward.placement == "workers" and config.trainer.nnodes > 1:
        raise ConfigValueError(
            "reward.placement",
            "workers",
            "must be driver with a colocated judge (reward.model.placement=colocated) on several machines "
            f"(trainer.nnodes={config.trainer.nnodes}): the judge listens on the driver's 127.0.0.1",
            hint=" Set reward.placement=driver, or serve the judge yourself and use placement=external.",
        )
    from trellis.config.schema import ModelConfig, RolloutConfig
    from trellis.registries import rollout_replicas
    from trellis.utils.tokenizer import hf_tokenizer

    replica_cls = rollout_replicas.get(model.replica)  # a bad name fails before anything starts
    from trellis.rollout.gateway import Gateway, start_gateway

    trust = bool(config.model.trust_remote_code)
    rollout_config = RolloutConfig(name=model.replica, mode="colocated", seed=config.trainer.seed)
    model_config = ModelConfig(path=model.path, dtype=config.model.dtype, trust_remote_code=trust)
    tokenizer = hf_tokenizer(model.path, trust_remote_code=trust)
    replica = replica_cls(0, rollout_config, model_config)
    served = Gateway(tokenizer, replicas=[replica], model_name=model.path, max_inflight=model.max_concurrency)
    gateway = start_gateway(served, host="127.0.0.1", port=0)
    try:
        gateway.call(replica.init("colocated", tokenizer=tokenizer, device=_judge_device(config)))
    except BaseException:
        gateway.stop()
        raise
    model.base_url = gateway.base_url
    logger.info("Serving the judge %s at %s.", model.path, gateway.base_url)
    return RunningJudge(base_url=gateway.base_url, replica=replica, gateway=gateway, config=config)
