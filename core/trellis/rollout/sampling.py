"""A generation request's parameters (:class:`SamplingParams`) and its result (:class:`TokenOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

StopReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response. Validated on construction (``ValueError`` naming the field).

    Attributes:
        temperature: divides the logits before softmax; ``0`` = greedy (argmax).
        top_p: nucleus mass in ``(0, 1]``; 1.0 = off.
        top_k: sample among the k most likely tokens; ``-1`` = off.
        max_tokens: most tokens generated (>= 1).
        stop_token_ids: token ids that end the response (besides the model's eos); the stop token
            is included in ``TokenOutput.token_ids``.
        stop: strings that end the response once the decoded response contains one; tokens up to
            and including the one that completes the string are returned.
        seed: per-request seed; the same seed, prompt and weights give the same tokens whatever
            other requests are batched with it. None = the replica's own generator.
        logprobs: return each sampled token's log-prob (True, or an int >= 0 as vLLM spells it;
            only the sampled token's log-prob is returned, never top-N alternatives).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool | int = False

    def __post_init__(self) -> None:
        # frozen: normalise lists to tuples through object.__setattr__ so params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        stop = self.stop
        object.__setattr__(self, "stop", (stop,) if isinstance(stop, str) else tuple(stop or ()))
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}.")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}.")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}.")
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or not (self.top_k == -1 or self.top_k >= 1)
        ):
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}.")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(
                    f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}."
                )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}.")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}.")
        if not isinstance(self.logprobs, bool) and not (
            isinstance(self.logprobs, int) and self.logprobs >= 0
        ):
            raise ValueError(f"logprobs must be a bool or an integer >= 0, got {self.logprobs!r}.")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (``temperature == 0``)."""
        return self.temperature == 0

    @property
    def wants_logprobs(self) -> bool:
        """True when per-token log-probs are to be returned (``logprobs`` True or an int)."""
        return self.logprobs is not False


@dataclass
class TokenOutput:
    """One finished response.

    Attributes:
        token_ids: generated tokens (prompt excluded), at most ``max_tokens``.
        log_probs: one float per token when asked for (see the replica for which distribution),
            else None.
        stop_reason: ``"stop"`` (eos, a stop token or string), ``"length"`` (hit ``max_tokens``) or
            ``"abort"`` (the replica shut down before the request ran).
        num_preempted: times the backend preempted the request (None when it does not say).
        weight_versions: per token, the version of the weights that generated it (see
            :attr:`~trellis.rollout.RolloutReplica.weight_version`); several versions when a weight
            update interrupted the request and it resumed with the new weights
            (``rollout.partial_rollout``). None when the backend does not say.
    """

    token_ids: list[int]
    log_probs: list[float] | None = None
    stop_reason: StopReason = "length"
    num_preempted: int | None = field(default=None)
    weight_versions: list[int] | None = None
