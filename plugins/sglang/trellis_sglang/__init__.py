"""SGLang rollout replica for Trellis. Importing it imports neither sglang nor torch.

The replica is :class:`trellis_sglang.replica.SGLangRolloutReplica`, registered as ``sglang`` in
``trellis.rollout_replicas`` (select it with ``rollout.name=sglang``). Everything that talks to
SGLang itself lives in :mod:`trellis_sglang.engine`; :mod:`trellis_sglang.testing` holds a fake
SGLang that runs a Hugging Face model on the CPU, for tests.
"""

__version__ = "0.1.0"
