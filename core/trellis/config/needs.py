"""What the configured estimator and policy loss need, read from their declarations.

An advantage estimator or a policy loss declares its needs where it registers
(``register_adv_est(name, requires=("values",))``, or ``@requires("values")`` on an entry point; the
vocabulary is ``trellis.registries.NEEDS``). :func:`resolve_needs` reads them and settles the fields
that depend on them:

- ``values``: ``critic.enable: null`` turns the critic on; ``critic.enable: false`` is an error;
- ``ref_log_prob``: ``ref.enable: null`` turns the reference on; ``false`` is an error;
- ``groups``: ``rollout.n`` must be at least 2;
- ``rollout_log_probs``: ``rollout.calculate_log_probs`` must be true;
- ``reward_baselines``, ``old_log_probs``: nothing to check; the trainer provides them.

Reading a declaration imports the component (and torch), which ``load_config`` never does; the trainer
calls :func:`resolve_needs` when it builds the run, and so does ``trellis train --print-config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trellis.config.base import ConfigValueError


@dataclass(frozen=True)
class RunNeeds:
    """The needs of the run's estimator and policy loss (names in ``trellis.registries.NEEDS``)."""

    estimator: frozenset[str] = frozenset()
    policy_loss: frozenset[str] = frozenset()

    def __contains__(self, need: object) -> bool:
        return need in self.estimator or need in self.policy_loss


def resolve_needs(config: Any) -> RunNeeds:
    """Read what ``algorithm.adv_estimator`` and ``actor.policy_loss`` declare; derive and check the
    fields that depend on it (see the module docstring). Calling it again changes nothing.

    Raises:
        ConfigValueError: a setting contradicts a declared need (the message names the key, the value,
            the component and what it needs).
        UnknownComponentError: an estimator or loss name that nothing registers.
    """
    from trellis.registries import advantage_estimators, needs_of, policy_losses

    algorithm, actor, critic, ref, rollout = (
        config.algorithm,
        config.actor,
        config.critic,
        config.ref,
        config.rollout,
    )
    needs = RunNeeds(
        estimator=needs_of(advantage_estimators.get(algorithm.adv_estimator), "advantage estimator"),
        policy_loss=needs_of(policy_losses.get(actor.policy_loss), "policy loss"),
    )

    def who(need: str) -> str:
        if need in needs.estimator:
            return f"algorithm.adv_estimator {algorithm.adv_estimator!r}"
        return f"actor.policy_loss {actor.policy_loss!r}"

    if critic.enable is None:
        critic.enable = "values" in needs
    elif "values" in needs and not critic.enable:
        raise ConfigValueError(
            "critic.enable", False, f"must be true (or null) with {who('values')}, which needs values"
        )
    if ref.enable is None:
        ref.enable = "ref_log_prob" in needs
    elif "ref_log_prob" in needs and not ref.enable:
        raise ConfigValueError(
            "ref.enable",
            False,
            f"must be true (or null) with {who('ref_log_prob')}, which needs reference log-probs",
        )
    if "groups" in needs and rollout.n < 2:
        raise ConfigValueError(
            "rollout.n",
            rollout.n,
            f"must be >= 2 with {who('groups')}, which compares the responses to one prompt",
        )
    if "rollout_log_probs" in needs and not rollout.calculate_log_probs:
        raise ConfigValueError(
            "rollout.calculate_log_probs",
            False,
            f"must be true with {who('rollout_log_probs')}, which needs the rollout's log-probs",
        )
    if critic.enable:
        config.check_batches("critic", critic)
    return needs
