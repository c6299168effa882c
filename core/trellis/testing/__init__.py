"""The plugin author's conformance kit: pytest contract classes to subclass in a plugin's tests.

    from trellis.testing import RegistryEntryContract

    class TestMyEstimator(RegistryEntryContract):
        registry = "advantage_estimators"
        name = "my_adv"

Each contract is a plain class of ``test_*`` methods; pytest collects them through the
``Test*`` subclass. Later contracts (one per component kind) build on this one.
"""

from trellis.testing.checkpoint import CheckpointEngineContract
from trellis.testing.device import DeviceBackendContract
from trellis.testing.registry import RegistryEntryContract
from trellis.testing.replay import ReplayPoolContract
from trellis.testing.rollout import RolloutReplicaContract

__all__ = [
    "CheckpointEngineContract",
    "DeviceBackendContract",
    "RegistryEntryContract",
    "ReplayPoolContract",
    "RolloutReplicaContract",
]
