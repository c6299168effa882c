"""``DataProtoFuture``: a DataProto still being computed by a worker group.

A non-blocking call (``@register(..., blocking=False)``) of a DataProto-collecting mode returns one.
Passing it to the next call hands each worker a *chunk* of the future, which the worker resolves
itself (inside the actor), so the data flows from one stage's workers to the next's
without passing through the driver. ``future.get()`` resolves it in the driver.
"""

from __future__ import annotations

from typing import Any

from trellis.data.protocol import DataProto


def _is_ref(value: Any) -> bool:
    return type(value).__name__ == "ObjectRef"


def _resolve(futures: list[Any]) -> list[Any]:
    if any(_is_ref(f) for f in futures):
        import ray

        return ray.get(list(futures))
    return list(futures)


async def _resolve_async(futures: list[Any]) -> list[Any]:
    import asyncio

    return list(await asyncio.gather(*(_awaited(f) for f in futures)))


async def _awaited(value: Any) -> Any:
    return await value if _is_ref(value) else value


class DataProtoFuture:
    """The concatenation of the DataProto outputs ``futures`` (Ray object refs or plain values).

    Args:
        futures: one per collected worker, in data-parallel order.
        pad_size: rows of padding to strip from the end of the concatenation.
        chunk_index: ``(i, n)``: this future is chunk ``i`` of ``n`` of that result; None = all of it.
    """

    def __init__(self, futures: list[Any], pad_size: int = 0, chunk_index: tuple[int, int] | None = None):
        self.futures = list(futures)
        self.pad_size = int(pad_size)
        self.chunk_index = chunk_index

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """``chunks`` futures, each resolving to one equal part of this one's result."""
        if self.chunk_index is not None:
            raise ValueError("A chunk of a DataProtoFuture cannot be chunked again; resolve it first.")
        return [DataProtoFuture(self.futures, self.pad_size, (i, chunks)) for i in range(chunks)]

    def get(self) -> DataProto:
        """The DataProto (blocks until every worker finished).

        Raises:
            ValueError: chunked, but the result's rows do not divide evenly into the chunks.
        """
        return self._assemble(_resolve(self.futures))

    async def get_async(self) -> DataProto:
        """:meth:`get` for async code (an async Ray actor must not block its event loop in ``ray.get``)."""
        return self._assemble(await _resolve_async(self.futures))

    def _assemble(self, parts: list[Any]) -> DataProto:
        from trellis.data.protocol import unpad_dataproto

        data = unpad_dataproto(DataProto.concat(parts), self.pad_size)
        if self.chunk_index is None:
            return data
        i, n = self.chunk_index
        if len(data) % n:
            raise ValueError(
                f"A DataProtoFuture of {len(data)} rows cannot be split evenly over {n} workers; make the "
                "batch a multiple of the world size, or resolve it (future.get()) before the call."
            )
        return data.chunk(n)[i]

    def __repr__(self) -> str:
        where = "" if self.chunk_index is None else f", chunk {self.chunk_index[0]} of {self.chunk_index[1]}"
        return f"DataProtoFuture({len(self.futures)} parts{where})"
