"""Exceptions raised by Trellis.

Every error says what was wrong, with the offending value, and what to do about it.
All of them derive from :class:`TrellisError`, so ``except TrellisError`` catches any of them.
"""

from __future__ import annotations


class TrellisError(Exception):
    """Base class of every error Trellis raises on purpose."""


class UnknownComponentError(TrellisError, LookupError):
    """A name was asked of a registry that has nothing under it.

    The message lists the available names and the closest match.
    """

    def __init__(self, message: str, *, name: str, available: list[str], closest: str | None):
        super().__init__(message)
        self.name = name
        self.available = available
        self.closest = closest


class PluginLoadError(TrellisError, ImportError):
    """An entry point (or a reference) could not be imported.

    Raised only when the broken name is requested; other names keep working.
    The original exception is chained as ``__cause__``.
    """


class DuplicateComponentError(TrellisError):
    """Two providers claim one name in one registry."""


class ProtocolMismatchError(TrellisError, TypeError):
    """A loaded component does not fit the protocol of its registry."""


class InvalidReferenceError(TrellisError, ValueError):
    """A ``package.module:attr`` or ``path/to/file.py:attr`` reference is malformed or dangling."""


class DataProtoError(TrellisError, ValueError):
    """A ``DataProto`` was built or used inconsistently (sizes, types, keys, indices).

    The message names the key and the sizes or types involved.
    """


class ConfigError(TrellisError, ValueError):
    """A configuration has an unknown key, a value of the wrong type, or an invalid value.

    The message names the full dotted key, the bad value and, for unknown keys, the closest
    valid key.
    """


class DatasetError(TrellisError, ValueError):
    """A dataset file is missing, unreadable or malformed.

    The message names the file, the row number (0-based) and the column.
    """


class HdfsUnavailableError(TrellisError, RuntimeError):
    """An ``hdfs://`` path was given, but neither the ``hdfs`` command nor pyarrow's HDFS client works."""


class DataProtoIndexError(DataProtoError, IndexError):
    """An index out of range for a ``DataProto``; also an ``IndexError``, as Python code expects."""


class DeviceError(TrellisError, RuntimeError):
    """A device backend was asked for something it cannot do as asked.

    For example an event timed before it was recorded, or a device index out of range.
    """


class DeviceUnavailableError(DeviceError):
    """A device backend was selected on a machine where it is not available.

    The message gives the backend's :meth:`DeviceBackend.unavailable_reason` and the backends
    that are available instead.
    """


class EngineError(TrellisError, RuntimeError):
    """A training engine was used in a way its role or state does not allow; the message says the fix."""


class CheckpointError(TrellisError, RuntimeError):
    """A training checkpoint is missing, incomplete or corrupt, or cannot be written; the message
    names its path."""


class WeightSyncError(TrellisError, RuntimeError):
    """Weights could not be transferred to the rollout replicas (a peer vanished, a bucket did not
    match, a transport failed); the message names the engine and what went wrong."""


class RolloutReplicaError(TrellisError, RuntimeError):
    """A rollout replica in a process of its own died, did not start or stopped answering; the
    message names the replica (its rank and process) and what happened."""


class ReplayPoolError(TrellisError, ValueError):
    """A bad replay-pool argument or group, or a saved pool that cannot be loaded as written; the
    message names the argument, the group or the file."""
