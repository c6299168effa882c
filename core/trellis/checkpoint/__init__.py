"""Checkpoints, both kinds: weight sync from the trainer to the rollout replicas (checkpoint engines,
registry ``trellis.checkpoint_engines``), and training checkpoints (save, resume, export).

from trellis.checkpoint import CheckpointEngine, WeightSyncManager, CheckpointManager
"""

from trellis.utils.lazy import lazy_attributes

_LAZY = {
    # weight sync
    "CheckpointEngine": "trellis.checkpoint.base:CheckpointEngine",
    "NaiveCheckpointEngine": "trellis.checkpoint.naive:NaiveCheckpointEngine",
    "ShmCheckpointEngine": "trellis.checkpoint.shm:ShmCheckpointEngine",
    "GlooCheckpointEngine": "trellis.checkpoint.distributed:GlooCheckpointEngine",
    "NcclCheckpointEngine": "trellis.checkpoint.distributed:NcclCheckpointEngine",
    "WeightSyncManager": "trellis.checkpoint.sync:WeightSyncManager",
    # training checkpoints
    "CheckpointManager": "trellis.checkpoint.training:CheckpointManager",
    "export_to_hf": "trellis.checkpoint.export:export_to_hf",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_attributes("trellis.checkpoint", _LAZY, globals())
