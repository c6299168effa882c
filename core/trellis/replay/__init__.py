"""Replay pools: the bounded buffer of response groups that rollout fills and training drains
(the buffer of the async mode, and the way a run reuses samples).

A pool is selected by name from the ``trellis.replay_pools`` registry: ``fifo`` (oldest first),
``uniform`` (seeded random, the RNG saved with the pool) or ``prioritized`` (highest
``priority_key`` first). One round::

    from trellis.registries import replay_pools

    pool = replay_pools.get("fifo")(capacity=64, eviction="stalest")
    # groups: DataProtos with non_tensors["sample_id"] and meta_info["weight_version"]
    evicted = pool.add(groups)
    stale = pool.drop_stale(current_version=step, max_staleness=2)
    batch = pool.sample(8)                # removed from the pool: each sample is trained once
    pool.save(ckpt_dir / "replay")        # atomic; ReplayPool.load(dir) verifies format and checksums

Modules: ``pool`` (the protocol, the built-ins and the on-disk format). Names below import on first
access.
"""

from __future__ import annotations

from trellis.utils.lazy import lazy_attributes

# public name -> "module:attr", imported on first access
_LAZY: dict[str, str] = {
    "ReplayPool": "trellis.replay.pool:ReplayPool",
    "ReplayPoolError": "trellis.replay.pool:ReplayPoolError",
    "FifoReplayPool": "trellis.replay.pool:FifoReplayPool",
    "UniformReplayPool": "trellis.replay.pool:UniformReplayPool",
    "PrioritizedReplayPool": "trellis.replay.pool:PrioritizedReplayPool",
    "load_pool": "trellis.replay.pool:load_pool",
    "FORMAT_VERSION": "trellis.replay.pool:FORMAT_VERSION",
    "VERSION_KEY": "trellis.replay.pool:VERSION_KEY",
}

__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_attributes("trellis.replay", _LAZY, globals())
