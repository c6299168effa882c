"""Contract tests for a replay pool (registry ``trellis.replay_pools``).

    from trellis.testing import ReplayPoolContract

    class TestMyPool(ReplayPoolContract):
        pool_name = "my_pool"                        # resolved through trellis.replay_pools
        pool_kwargs = {"priority_key": "score"}      # more constructor arguments, if any

Groups built by :meth:`ReplayPoolContract.make_group` carry ``meta_info["score"]`` (a number) and a
tensor ``"score"`` too, so a pool that orders by a key can be pointed at it. Override
:meth:`make_pool` where the pool is built another way.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from trellis.testing.registry import RegistryEntryContract

__all__ = ["ReplayPoolContract", "groups_equal", "make_group"]


def make_group(ids: list[Any], version: int, score: float = 0.0, id_key: str = "sample_id") -> Any:
    """One group: a row per id with tensors ``responses`` (rows, 3) and ``score`` (rows,), the ids in
    ``non_tensors[id_key]``, a ``prompt`` column, and ``meta_info`` ``weight_version`` and ``score``."""
    from trellis.data.protocol import DataProto

    rows = len(ids)
    base = sum(zlib.crc32(str(i).encode()) % 997 for i in ids)
    return DataProto.from_dict(
        tensors={
            "responses": torch.arange(rows * 3, dtype=torch.long).reshape(rows, 3) + base,
            "score": torch.full((rows,), float(score)),
        },
        non_tensors={id_key: list(ids), "prompt": [f"prompt of {ids[0]}"] * rows},
        meta_info={"weight_version": version, "score": float(score)},
    )


def groups_equal(a: Any, b: Any) -> bool:
    """Whether two DataProtos hold the same tensors, non-tensor columns and meta_info."""
    if (
        len(a) != len(b)
        or a.meta_info != b.meta_info
        or sorted(a.non_tensor_batch) != sorted(b.non_tensor_batch)
    ):
        return False
    for key, column in a.non_tensor_batch.items():
        if column.tolist() != b.non_tensor_batch[key].tolist():
            return False
    if (a.batch is None) != (b.batch is None):
        return False
    if a.batch is None:
        return True
    if sorted(a.batch.keys()) != sorted(b.batch.keys()):
        return False
    return all(torch.equal(a.batch[k], b.batch[k]) for k in a.batch.keys())  # noqa: SIM118 - TensorDict has no `in`


def _ids(groups: list[Any], id_key: str = "sample_id") -> list[Any]:
    return [i for g in groups for i in g.non_tensor_batch[id_key].tolist()]


class ReplayPoolContract(RegistryEntryContract):
    """Proves a replay pool honours :class:`trellis.replay.ReplayPool`.

    Class attributes to set in the subclass:
        pool_name: the name it registers in ``trellis.replay_pools``.
        pool_class: the class itself, to test one that is not (yet) registered; with ``pool_name``
            too, the registry must resolve the name to this class.
        pool_kwargs: more constructor arguments for every pool the tests build.
    """

    registry: ClassVar[str] = "replay_pools"
    pool_name: ClassVar[str | None] = None
    pool_class: ClassVar[type | None] = None
    pool_kwargs: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.pool_name is not None:
            cls.name = cls.pool_name

    def _pool_class(self) -> Any:
        if self.pool_name is not None:
            cls = self._registry().get(self.pool_name)
            if self.pool_class is not None:
                assert cls is self.pool_class, (
                    f"the registry resolves {self.pool_name!r} to {cls!r}, not {self.pool_class!r}"
                )
            return cls
        if self.pool_class is None:
            raise TypeError(f"{type(self).__name__}: set pool_name or pool_class.")
        return self.pool_class

    def _component(self) -> Any:
        return self._pool_class()

    def make_pool(self, capacity: int, **kwargs: Any) -> Any:
        """A fresh pool of ``capacity`` groups with :attr:`pool_kwargs` and ``kwargs``."""
        return self._pool_class()(capacity=capacity, **{**self.pool_kwargs, **kwargs})

    # ---------------------------------------------------------------- the tests

    def test_add_and_sample_counts(self) -> None:
        pool = self.make_pool(8)
        assert len(pool) == 0 and pool.capacity == 8 and pool.sample(3) == []
        assert pool.add([make_group([f"g{i}a", f"g{i}b"], version=0, score=i) for i in range(5)]) == []
        assert len(pool) == 5
        got = pool.sample(3)
        assert len(got) == 3 and len(pool) == 2
        assert len(pool.sample(10)) == 2 and len(pool) == 0
        state = pool.state
        assert (state["size"], state["adds"], state["samples"], state["evictions"], state["drops"]) == (
            0,
            5,
            5,
            0,
            0,
        )

    def test_sample_without_remove_keeps_groups(self) -> None:
        pool = self.make_pool(4)
        pool.add([make_group([i], version=0, score=i) for i in range(3)])
        kept = pool.sample(2, remove=False)
        assert len(kept) == 2 and len(pool) == 3
        assert sorted(_ids(pool.sample(3))) == [0, 1, 2]

    def test_capacity_evicts_the_oldest(self) -> None:
        pool = self.make_pool(3, eviction="oldest")
        evicted = pool.add([make_group([i], version=0, score=1.0) for i in range(5)])
        assert _ids(evicted) == [0, 1] and len(pool) == 3
        assert sorted(pool.sample_ids()) == [2, 3, 4] and pool.state["evictions"] == 2

    def test_capacity_evicts_the_stalest(self) -> None:
        pool = self.make_pool(3, eviction="stalest")
        pool.add([make_group([i], version=v, score=1.0) for i, v in enumerate([5, 2, 7])])
        assert _ids(pool.add(make_group([3], version=6, score=1.0))) == [1]
        assert _ids(pool.add(make_group([4], version=1, score=1.0))) == [4]  # itself the stalest
        assert sorted(pool.sample_ids()) == [0, 2, 3]

    def test_duplicate_ids_are_refused(self) -> None:
        import pytest

        from trellis.replay import ReplayPoolError

        pool = self.make_pool(4)
        pool.add(make_group(["a", "b"], version=0))
        with pytest.raises(ReplayPoolError, match="already in the replay pool"):
            pool.add([make_group(["c"], version=0), make_group(["b"], version=0)])
        assert pool.sample_ids() == ["a", "b"]  # nothing of the refused add went in

    def test_no_sample_lost_or_returned_twice(self) -> None:
        rng = random.Random(1)
        pool = self.make_pool(16, eviction="stalest")
        added: list[Any] = []
        out: list[Any] = []
        for step in range(60):
            groups = [
                make_group([f"s{step}-{j}-{r}" for r in range(rng.randint(1, 3))], step // 3, rng.random())
                for j in range(rng.randint(0, 4))
            ]
            added += _ids(groups)
            out += _ids(pool.add(groups))
            out += _ids(pool.sample(rng.randint(0, 4)))
            if step % 7 == 6:
                out += _ids(pool.drop_stale(step // 3, 2))
        out += pool.sample_ids()
        counts = Counter(out)
        assert sorted(counts) == sorted(added) and set(counts.values()) == {1}

    def test_save_load_round_trip(self, tmp_path: Path) -> None:
        pool = self.make_pool(6, seed=7)
        pool.add([make_group([f"{i}a", f"{i}b"], version=i, score=(i * 3) % 5) for i in range(9)])
        pool.sample(1)
        pool.save(tmp_path / "pool")
        loaded = type(pool).load(tmp_path / "pool")
        assert type(loaded) is type(pool) and loaded.state == pool.state and loaded.capacity == 6
        assert loaded.sample_ids() == pool.sample_ids()
        for _ in range(3):  # the next draws match: the RNG state travels with the pool
            a, b = pool.sample(2), loaded.sample(2)
            assert len(a) == len(b) and all(groups_equal(x, y) for x, y in zip(a, b, strict=True))
        from trellis.replay import load_pool

        assert type(load_pool(tmp_path / "pool")) is type(pool)

    def test_corrupted_file_is_detected(self, tmp_path: Path) -> None:
        import pytest

        from trellis.replay import ReplayPoolError

        pool = self.make_pool(4)
        pool.add([make_group([i], version=0, score=i) for i in range(3)])
        pool.save(tmp_path / "pool")
        (data,) = (tmp_path / "pool").glob("groups-*.pt")
        blob = data.read_bytes()
        data.write_bytes(blob[: len(blob) // 2])
        with pytest.raises(ReplayPoolError, match=data.name):
            type(pool).load(tmp_path / "pool")
        data.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
        with pytest.raises(ReplayPoolError, match="checksum"):
            type(pool).load(tmp_path / "pool")
        data.write_bytes(blob)
        assert len(type(pool).load(tmp_path / "pool")) == 3

    def test_drop_stale(self) -> None:
        pool = self.make_pool(8)
        pool.add([make_group([i], version=v, score=1.0) for i, v in enumerate([0, 3, 1, 4, 2])])
        dropped = pool.drop_stale(current_version=4, max_staleness=2)
        assert sorted(_ids(dropped)) == [0, 2] and sorted(pool.sample_ids()) == [1, 3, 4]
        assert pool.state["drops"] == 2 and pool.drop_stale(4, 2) == []
        assert np.array_equal(sorted(_ids(pool.sample(8))), [1, 3, 4])
