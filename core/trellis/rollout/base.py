"""The rollout-replica protocol: one generation server, driven by asyncio from the trainer.

A replica is built as ``cls(replica_rank, rollout_config, model_config)`` and then awaited
through its lifecycle::

    replica = get_rollout_replica_class("hf")(0, cfg.rollout, cfg.model)
    await replica.init("hybrid", model=policy_module, tokenizer=tokenizer)
    out = await replica.generate(prompt_ids, SamplingParams(max_tokens=64), request_id="r0")
    await replica.sleep()                 # training runs; generation memory is released
    await replica.update_weights(engine.iter_full_params())
    await replica.wake_up()

Weight versions. ``weight_version`` counts the policy updates the replica's weights hold (0: the
initial weights). An update that may run while requests are in flight (``trainer.mode=async``) is
bracketed by :meth:`RolloutReplica.begin_weight_update` and :meth:`RolloutReplica.end_weight_update`
(the checkpoint engine's receiving half calls them around the buckets): no token is generated with
half-loaded weights, and every token is stamped with the version that produced it
(``TokenOutput.weight_versions``). With ``rollout.partial_rollout`` the backend interrupts the
requests in flight at ``begin`` and resumes the same sequences with the new weights after ``end``.

Modes (``rollout.mode``):

- ``hybrid``: the replica lives in a training worker's process and shares its weights; the
  caller passes the model object to ``init``.
- ``colocated``: own copy of the weights, on the same devices as training.
- ``standalone``: own copy on devices of its own.

Backends that serve over the network expose ``server_address`` (``"host:port"``); in-process
ones return None.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from trellis.rollout.sampling import SamplingParams, TokenOutput


def has_items(multi_modal_data: Any) -> bool:
    """Whether a ``multi_modal_data`` cell (None or ``{"image": [...], "video": [...]}``) holds any item."""
    return isinstance(multi_modal_data, Mapping) and any(len(v or ()) for v in multi_modal_data.values())


MODES = ("hybrid", "colocated", "standalone")
"""The deployment modes every replica accepts in :meth:`RolloutReplica.init`."""


class RolloutReplica(abc.ABC):
    """Base class of generation backends (registry ``trellis.rollout_replicas``).

    Args:
        replica_rank: index of this replica among the trainer's replicas.
        rollout_config: a :class:`trellis.config.schema.RolloutConfig` (``engine_kwargs`` carries
            backend options).
        model_config: a :class:`trellis.config.schema.ModelConfig` (``path``, ``dtype``, ...).
    """

    supports_multi_modal: ClassVar[bool] = False
    """Whether :meth:`generate` takes images and videos (``multi_modal_data``) for vision-language models."""

    def __init__(self, replica_rank: int, rollout_config: Any, model_config: Any) -> None:
        self.replica_rank = replica_rank
        self.rollout_config = rollout_config
        self.model_config = model_config
        self.mode: str | None = None
        self.asleep = False  # between sleep() and wake_up(); generate refuses to run then
        self.weight_version = 0
        """The policy version of the served weights (set by :meth:`end_weight_update`)."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine (say how to fix it), or None when it can.

        ``trellis doctor`` lists it for every registered replica. Backends whose engine is an
        optional package or needs particular hardware override it; it must stay cheap: find the
        engine package (``importlib.util.find_spec``) rather than import it.
        """
        return None

    @staticmethod
    def check_mode(mode: str) -> str:
        """``mode`` itself when it is one of :data:`MODES`; else ``ValueError`` listing them."""
        if mode not in MODES:
            raise ValueError(f"Unknown rollout mode {mode!r}; expected one of: {', '.join(MODES)}.")
        return mode

    def check_request(
        self, prompt_ids: Any, sampling_params: Any, request_id: str, multi_modal_data: Any = None
    ) -> list[int]:
        """Validate one ``generate`` request; the prompt as a list of ints.

        Raises:
            RuntimeError: the replica is asleep (``wake_up`` first).
            TypeError: ``sampling_params`` is not a :class:`SamplingParams`.
            ValueError: the prompt is empty (the message names the request); images or videos for a
                replica that does not take them (:attr:`supports_multi_modal`).
        """
        name = type(self).__name__
        if has_items(multi_modal_data) and not self.supports_multi_modal:
            raise ValueError(
                f"request {request_id!r}: {name} does not take images or videos; serve vision-language "
                "models with a replica that does (rollout.name=hf or vllm)."
            )
        if self.asleep:
            raise RuntimeError(f"{name} is asleep: await replica.wake_up() before generate.")
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(
                f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}."
            )
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_ids is empty; give at least one token.")
        return prompt

    @abc.abstractmethod
    async def init(
        self, mode: str = "hybrid", *, model: Any = None, tokenizer: Any = None, device: Any = None
    ) -> None:
        """Start the replica in ``mode`` (one of :data:`MODES`).

        ``model`` / ``tokenizer`` are the training worker's objects (hybrid); otherwise the replica
        loads its own from ``model_config.path``. ``device`` is where it runs (default: the
        backend's choice). Raises ``ValueError`` for an unknown mode or a missing model.
        """

    @abc.abstractmethod
    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        multi_modal_data: Mapping[str, Any] | None = None,
    ) -> TokenOutput:
        """The response to ``prompt_ids`` (token ids, no padding). Concurrent calls are allowed.

        ``multi_modal_data`` (``{"image": [PIL images], "video": [[frames], ...]}``) holds the prompt's
        items, in the order of their pad tokens in ``prompt_ids``; callers pass it only when there are
        items, and only to replicas whose :attr:`supports_multi_modal` is true."""

    @abc.abstractmethod
    async def sleep(self) -> None:
        """Release generation memory (KV cache, possibly weights) so training can use it."""

    @abc.abstractmethod
    async def wake_up(self) -> None:
        """Restore what :meth:`sleep` released; generation works again afterwards."""

    @abc.abstractmethod
    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load ``(name, tensor)`` pairs (Hugging Face parameter names) into the served model in place."""

    async def begin_weight_update(self) -> None:
        """Called once before the buckets of one weight update arrive (:meth:`update_weights` calls).

        Backends that serve while training runs hold generation here until :meth:`end_weight_update`
        (and, with ``rollout.partial_rollout``, interrupt the requests in flight, to resume them with
        the new weights). The default does nothing: the caller does not generate during the update.
        """
        return None

    async def end_weight_update(self, version: int | None = None) -> None:
        """Called once after the last bucket: the weights are now policy version ``version`` (None:
        one more than before). Generation held by :meth:`begin_weight_update` continues."""
        self.weight_version = self.weight_version + 1 if version is None else int(version)

    @property
    def server_address(self) -> str | None:
        """``"host:port"`` of the replica's server, or None for an in-process backend."""
        return None
