"""Worker classes for the worker-group tests (a module of its own so Ray actors can import it)."""

from __future__ import annotations

import os

import torch

from trellis.data.protocol import DataProto
from trellis.distributed import Dispatch, Execute, Worker, make_nd_compute_dataproto_dispatch_fn, register


class Doubler(Worker):
    """Records what each rank received; doubles DataProto rows."""

    def __init__(self, scale: int = 2) -> None:
        self.scale = scale
        self.seen: list[int] = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self, tag: str) -> tuple[str, int, int]:
        return tag, self.rank, self.world_size

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def add(self, x: int, y: int) -> int:
        return x + y + self.rank

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def square(self, x: int) -> int:
        return x * x

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        self.seen.append(len(data))
        x = data.batch["x"]
        return DataProto.from_dict(
            tensors={"y": x * self.scale, "rank": torch.full_like(x, self.rank)},
            non_tensors={"tag": data.non_tensor_batch["tag"]},
        )

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double_async(self, data: DataProto) -> DataProto:
        return self.double(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    async def plus_one(self, data: DataProto) -> DataProto:  # async methods run to completion too
        return DataProto.from_dict(tensors={"x": data.batch["y"] + 1})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metrics(self, data: DataProto) -> dict[str, float]:
        return {"rows": float(len(data)), "rank": float(self.rank)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def only_rank_zero(self) -> int:
        return self.rank + 100

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def seen_sizes(self) -> list[int]:
        return list(self.seen)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


class MeshWorker(Worker):
    """Ranks form a (dp=world/2, tp=2) mesh: tp peers share a chunk; tp rank 0 is collected."""

    def __init__(self) -> None:
        self._register_dispatch_collect_info("train", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("train"))
    def run(self, data: DataProto) -> DataProto:
        x = data.batch["x"]
        return DataProto.from_dict(tensors={"x": x, "worker": torch.full_like(x, self.rank)})


class Ref(Worker):
    def __init__(self, offset: int) -> None:
        self.offset = offset

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def shift(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={"y": data.batch["x"] + self.offset})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


class Gloo(Worker):
    """Joins torch.distributed (gloo) from the group's MASTER_ADDR / MASTER_PORT and all-reduces."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_dist(self) -> str:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        return os.environ["MASTER_ADDR"]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float) -> float:
        import torch.distributed as dist

        t = torch.tensor([value * (self.rank + 1)])
        dist.all_reduce(t)
        return float(t)
