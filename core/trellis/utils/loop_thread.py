"""An event loop of its own in a daemon thread, for engines that bind to the loop that starts them.

Async inference engines (vLLM's ``AsyncLLM``, SGLang's tokenizer manager) start background
tasks on the event loop that first uses them and break when a later call comes from another
loop. Trellis drives replicas from whatever loop the caller has, often one ``asyncio.run``
after another (each trainer step). A replica that owns a :class:`LoopThread` builds its engine
on that loop and hands every engine call to it::

    self._loop = LoopThread("my-engine")
    await self._loop.call(self._start_engine())        # the engine is created on the thread's loop
    out = await self._loop.call(self.engine.generate(...))   # from any caller loop
    self._loop.stop()

Cancelling the caller's await cancels the work on the engine loop too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any


class LoopThread:
    """An asyncio event loop running forever in a daemon thread named ``name``."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:  # stopped: the thread tears its loop down itself, whoever asked it to stop
            self.loop.run_until_complete(self._cancel_pending())
            # loop.close() would only signal the executor's threads (shutdown(wait=False))
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    async def _cancel_pending(self) -> None:
        tasks = [t for t in asyncio.all_tasks(self.loop) if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def running(self) -> bool:
        """Whether the loop still takes work (False after :meth:`stop`)."""
        return not self.loop.is_closed() and self.thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Schedule ``coro`` on the loop from any thread; a ``concurrent.futures.Future`` of its result.

        Raises:
            RuntimeError: the loop has been stopped (the coroutine is closed, not run).
        """
        if not self.running:
            coro.close()
            raise RuntimeError(f"LoopThread {self.thread.name!r} is stopped; it takes no more work.")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Await ``coro`` on this loop from the caller's loop; cancelling the caller cancels it."""
        future = self.submit(coro)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run ``coro`` on this loop and block the calling thread (never the loop's own) for its result."""
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("LoopThread.run called from its own thread would wait for itself forever.")
        return self.submit(coro).result(timeout)

    def stop(self, timeout: float = 30) -> None:
        """Stop the loop: pending tasks are cancelled, the default executor's threads (``asyncio.to_thread``
        calls made on the loop) joined, the loop closed. Idempotent.

        From another thread it waits up to ``timeout`` seconds for all that. From the loop's own
        thread (a callback or a finalizer running there) it only asks the loop to stop; the
        thread finishes the teardown once the current callback returns.
        """
        if self.loop.is_closed():
            return
        if threading.current_thread() is self.thread:
            self.loop.stop()
            return
        if self.thread.is_alive():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)
