"""RL algorithm math: advantage estimators, policy losses, KL, loss aggregation, rollout
correction and log-prob kernels. Pure functions on tensors, with no dependency on the trainer.

Shapes: ``(bs, T)`` over response tokens; ``response_mask`` is 1 on tokens the policy generated
(0 on padding and on tool-output tokens). Estimators and losses are registered through the
core's entry points (``trellis.advantage_estimators``, ``trellis.policy_losses``); resolve them
with ``trellis.registries.get_adv_estimator_fn`` / ``get_policy_loss_fn``.
"""
