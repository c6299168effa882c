"""Contract tests for a rollout replica (registry ``trellis.rollout_replicas``).

    from trellis.testing import RolloutReplicaContract

    class TestMyReplica(RolloutReplicaContract):
        replica_name = "my_backend"     # resolved through the registry
        mode = "colocated"

Each test builds a replica ``cls(0, RolloutConfig(...), ModelConfig(path=model_path, dtype="float32"))``,
awaits ``init`` and drives it inside one ``asyncio.run``. The ``model_path`` fixture builds the
tiny model of :mod:`trellis.recipes.tiny` unless the class sets ``model_path`` (a local HF folder)
or overrides the fixture. In ``hybrid`` mode the contract loads the model with transformers
and passes it to ``init``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Literal

from trellis.testing.registry import RegistryEntryContract

try:  # importing trellis.testing must not need pytest; the fixture exists where pytest does
    from pytest import fixture as _fixture
except ImportError:  # pragma: no cover

    def _fixture(**_: Any) -> Any:  # type: ignore[no-redef]  # the fallback when pytest is absent
        return lambda fn: fn


class RolloutReplicaContract(RegistryEntryContract):
    """Proves a rollout replica honours :class:`trellis.rollout.RolloutReplica`.

    Class attributes to set in the subclass:
        replica_name: the name it registers in ``trellis.rollout_replicas``.
        replica_class: the class itself, to test one that is not (yet) registered; with
            ``replica_name`` too, the registry must resolve the name to this class.
        model_path: a local HF model folder; None = the tiny model built by the fixture.
        mode: the mode to ``init`` with (``hybrid``, ``colocated`` or ``standalone``).
        engine_kwargs: passed as ``rollout.engine_kwargs``.
        max_tokens: response length the tests ask for.
    """

    registry: ClassVar[str] = "rollout_replicas"
    replica_name: ClassVar[str | None] = None
    replica_class: ClassVar[type | None] = None
    model_path: ClassVar[str | None] = None
    mode: ClassVar[Literal["hybrid", "colocated", "standalone"]] = "colocated"
    engine_kwargs: ClassVar[dict[str, Any]] = {}
    max_tokens: ClassVar[int] = 8

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.replica_name is not None:
            cls.name = cls.replica_name

    # ---------------------------------------------------------------- helpers

    @_fixture(name="model_path")
    def _model_path_fixture(self, tmp_path_factory: Any) -> str:
        given = type(self).model_path
        if given is not None:
            return given
        from trellis.recipes.tiny import save_tiny_model

        return save_tiny_model(tmp_path_factory.mktemp("rollout_contract_model"))

    def _replica_cls(self) -> type:
        if self.replica_name is not None:
            from trellis.registries import get_rollout_replica_class

            cls = get_rollout_replica_class(self.replica_name)
            if self.replica_class is not None:
                assert cls is self.replica_class, (
                    f"the registry resolves {self.replica_name!r} to {cls!r}, not {self.replica_class!r}"
                )
            return cls
        if self.replica_class is None:
            raise TypeError(f"{type(self).__name__}: set replica_name or replica_class.")
        return self.replica_class

    def _run(self, model_path: str, body: Callable[[Any], Awaitable[Any]]) -> Any:
        """``await body(replica)`` on an initialised replica, shutting it down afterwards."""
        from trellis.config.schema import ModelConfig, RolloutConfig

        async def main() -> Any:
            replica = self._replica_cls()(
                0,
                RolloutConfig(mode=self.mode, seed=0, engine_kwargs=dict(self.engine_kwargs)),
                ModelConfig(path=model_path, dtype="float32"),
            )
            kwargs: dict[str, Any] = {}
            if self.mode == "hybrid":
                from transformers import AutoModelForCausalLM, AutoTokenizer

                from trellis.utils.auto_model import load_pretrained

                kwargs["model"] = load_pretrained(AutoModelForCausalLM, model_path, dtype="float32")
                kwargs["tokenizer"] = AutoTokenizer.from_pretrained(model_path)
            await replica.init(self.mode, **kwargs)
            try:
                return await body(replica)
            finally:
                shutdown = getattr(replica, "shutdown", None)
                if shutdown is not None:
                    await shutdown()

        return asyncio.run(main())

    @staticmethod
    def _prompts(model_path: str, n: int) -> list[list[int]]:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_path)
        texts = ["What is 12 + 7?", "Compute 3 * 4 - 5.", "The quick brown fox", "Please solve the problem."]
        return [tok(texts[i % len(texts)] + " " * (i // len(texts)))["input_ids"] for i in range(n)]

    def _sp(self, **kw: Any) -> Any:
        from trellis.rollout import SamplingParams

        return SamplingParams(**{"max_tokens": self.max_tokens, **kw})

    # ---------------------------------------------------------------- the contract

    def test_class_is_a_rollout_replica(self) -> None:
        from trellis.rollout import RolloutReplica

        assert issubclass(self._replica_cls(), RolloutReplica)

    def test_unknown_mode_raises_listing_modes(self, model_path: str) -> None:
        import pytest

        from trellis.config.schema import ModelConfig, RolloutConfig

        replica = self._replica_cls()(0, RolloutConfig(), ModelConfig(path=model_path, dtype="float32"))
        with pytest.raises(ValueError, match="hybrid, colocated, standalone"):
            asyncio.run(replica.init("sideways"))

    def test_server_address(self, model_path: str) -> None:
        async def body(replica: Any) -> None:
            address = replica.server_address
            assert address is None or re.fullmatch(r"[^:\s]+:\d+", address), address

        self._run(model_path, body)

    def test_generate_returns_token_output(self, model_path: str) -> None:
        from trellis.rollout import TokenOutput

        prompt = self._prompts(model_path, 1)[0]

        async def body(replica: Any) -> None:
            vocab = replica_vocab_size(model_path)
            out = await replica.generate(prompt, self._sp(temperature=1.0, seed=1), "r0")
            assert isinstance(out, TokenOutput)
            assert 0 < len(out.token_ids) <= self.max_tokens
            assert all(isinstance(t, int) and 0 <= t < vocab for t in out.token_ids)
            assert out.stop_reason in ("stop", "length")
            assert out.log_probs is None
            with_lp = await replica.generate(prompt, self._sp(temperature=1.0, logprobs=True), "r1")
            assert with_lp.log_probs is not None and len(with_lp.log_probs) == len(with_lp.token_ids)
            assert all(lp <= 0 for lp in with_lp.log_probs)

        self._run(model_path, body)

    def test_greedy_is_deterministic(self, model_path: str) -> None:
        prompt = self._prompts(model_path, 1)[0]

        async def body(replica: Any) -> None:
            a = await replica.generate(prompt, self._sp(temperature=0), "a")
            b = await replica.generate(prompt, self._sp(temperature=0), "b")
            assert a.token_ids == b.token_ids

        self._run(model_path, body)

    def test_concurrent_generates_all_resolve(self, model_path: str) -> None:
        prompts = self._prompts(model_path, 8)

        async def body(replica: Any) -> None:
            solo = [
                (await replica.generate(p, self._sp(temperature=0), f"s{i}")).token_ids
                for i, p in enumerate(prompts)
            ]
            outs = await asyncio.wait_for(
                asyncio.gather(
                    *(replica.generate(p, self._sp(temperature=0), f"c{i}") for i, p in enumerate(prompts))
                ),
                timeout=120,
            )
            # Batched fp32 greedy may differ from solo only where two logits tie to rounding; the
            # first token comes from identical prompts' last position and must agree.
            assert all(0 < len(o.token_ids) <= self.max_tokens for o in outs)
            assert [o.token_ids[:1] for o in outs] == [s[:1] for s in solo]

        self._run(model_path, body)

    def test_sleep_then_wake_up_still_generates(self, model_path: str) -> None:
        prompt = self._prompts(model_path, 1)[0]

        async def body(replica: Any) -> None:
            before = await replica.generate(prompt, self._sp(temperature=0), "a")
            await replica.sleep()
            await replica.wake_up()
            after = await replica.generate(prompt, self._sp(temperature=0), "b")
            assert after.token_ids == before.token_ids

        self._run(model_path, body)

    def test_update_weights_changes_and_restores_output(self, model_path: str) -> None:
        import pytest
        import torch
        from transformers import AutoModelForCausalLM

        prompt = self._prompts(model_path, 1)[0]
        original = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32").state_dict()
        gen = torch.Generator().manual_seed(0)
        perturbed = {
            k: v + torch.randn(v.shape, generator=gen) * (v.float().std().nan_to_num(0.0) + 0.1)
            if v.is_floating_point()
            else v
            for k, v in original.items()
        }

        async def body(replica: Any) -> None:
            sp = self._sp(temperature=0, logprobs=True)
            base = await replica.generate(prompt, sp, "a")
            await replica.update_weights(iter(perturbed.items()))
            changed = await replica.generate(prompt, sp, "b")
            assert (changed.token_ids, changed.log_probs) != (base.token_ids, base.log_probs)
            await replica.update_weights(iter(original.items()))
            restored = await replica.generate(prompt, sp, "c")
            assert restored.token_ids == base.token_ids
            assert restored.log_probs == pytest.approx(base.log_probs, abs=1e-4)

        self._run(model_path, body)


def replica_vocab_size(model_path: str) -> int:
    """Vocabulary size of the model at ``model_path`` (from its config)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_path).vocab_size)


def check_grpo_run(
    replica_name: str,
    run_dir: str,
    *,
    steps: int = 3,
    log_prob_atol: float = 1e-4,
    weight_sync: bool = True,
    overrides: tuple[str, ...] | list[str] = (),
) -> Any:
    """Train the ``tiny`` preset with GRPO for ``steps`` steps on ``rollout.name=replica_name``, and check it.

    The end-to-end proof for a rollout backend: the trainer generates through the replica, syncs
    the updated weights into it after every step, and shuts it down at the end. Checks, per step:
    weight sync ran (``timing/weight_sync > 0``; pass ``weight_sync=False`` for a replica that
    serves the training module itself, like ``hf`` in hybrid mode), rewards in [0, 1], responses within the
    preset's 16 tokens, and the replica's log-probs equal the trainer's recomputation
    (``rollout_corr/ppl_ratio`` within ``log_prob_atol`` of 1, on the same fp32 weights); and that
    ``metrics.jsonl`` has one row per step. ``overrides`` are added last. Returns the
    :class:`~trellis.trainer.TrainResult` for more checks.
    """
    import json
    import os

    import trellis
    from trellis.recipes.presets import preset_overrides

    result = trellis.train(
        overrides=[
            *preset_overrides("tiny"),
            f"rollout.name={replica_name}",
            "rollout.calculate_log_probs=true",
            "algorithm.rollout_correction.rollout_is=token",
            f"trainer.total_training_steps={steps}",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.trackers=[jsonl]",
            "trainer.resume_mode=disable",
            f"trainer.run_dir={run_dir}",
            *overrides,
        ]
    )
    assert result.steps == steps and len(result.history) == steps, (result.steps, len(result.history))
    for step, metrics in enumerate(result.history, 1):
        if weight_sync:
            assert metrics["timing/weight_sync"] > 0, f"step {step}: no weight sync into the replica"
        assert 0 <= metrics["reward/mean"] <= 1, (step, metrics["reward/mean"])
        assert metrics["response_length/max"] <= 16, (step, metrics["response_length/max"])
        ratio = metrics["rollout_corr/ppl_ratio"]
        assert abs(ratio - 1) <= log_prob_atol, (
            f"step {step}: the replica's log-probs differ from the trainer's (ppl ratio {ratio})"
        )
    with open(os.path.join(result.run_dir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, steps + 1))
    return result


def teacher_forced_log_probs(
    model: Any, prompt_ids: list[int], token_ids: list[int], temperature: float = 1.0
) -> Any:
    """``log_softmax(logits / T)`` of each of ``token_ids`` after ``prompt_ids``, by one forward of ``model``.

    What a replica's log-probs must equal (the trainer computes the same): ``T = temperature``, or
    1 for greedy (``temperature == 0``). Returns a float32 tensor of ``len(token_ids)`` values.
    """
    import torch

    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    scale = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / scale, -1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]
