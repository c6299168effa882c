"""CPU cores shared by the processes of one run on one machine, lent by whoever is idle.

A trainer and standalone replicas on the same CPU each own some of its cores (``shares``: torch
intra-op threads). A fixed split leaves a core idle whenever its owner waits: the replica between
batches, the trainer while it waits for rollouts or validation. With a :class:`CoreShare`, a process
that computes runs its own threads *plus* the shares of every process that is idle at that moment,
and gives them back as soon as their owner computes again.

The state is one small file that every participant maps (``/dev/shm`` where there is one), with one
byte per participant: 1 while it computes, 0 while it waits. Each participant marks itself
(:meth:`CoreShare.busy`) and reads the others' bytes at boundaries of its own work
(:meth:`CoreShare.apply`: a decoder layer's forward or backward in training, a decode step in a
replica), so a lent core returns to its owner within one such step. Nothing blocks and nothing is
locked: a byte is written by its owner only, and a stale read costs at most one step with one thread
too many or too few.

Why it pays: on 2 cores, an async run's replica decoded about half the time while the trainer trained
on one thread beside it; docs/training.md ("Sharing the cores of one machine") has the measurements.

Layout: ``b"TCS1"``, the participant count ``n`` (one byte), ``n`` shares (one byte each), ``n``
busy bytes. Slot 0 is the process that created the file (the trainer); a replica's slot is
``replica_rank + 1``. A slot that never attaches stays busy, so its share is never lent.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import uuid
from collections.abc import Iterator, Sequence

MAGIC = b"TCS1"
MAX_PARTICIPANTS = 255
"""One byte holds the participant count."""


def _directory() -> str:
    """Where the file goes: shared memory where the machine has it (no disk write per step), else tmp."""
    return (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    )


class CoreShare:
    """One participant's view of a shared core ledger: its own slot and everyone's state.

    Use :meth:`create` (the owner, slot 0) or :meth:`attach` (another process, by path and slot), not
    the constructor.

    Attributes:
        path: the ledger file, for :meth:`attach` in other processes.
        slot: this participant's index.
        shares: every participant's own thread count, by slot.
        applied: :meth:`apply` calls so far; ``borrowed`` of them ran more threads than ``own``.
    """

    def __init__(self, path: str, slot: int, buffer: mmap.mmap, *, owner: bool) -> None:
        self.path, self.slot, self._map, self._owner = path, slot, buffer, owner
        count = buffer[len(MAGIC)]
        base = len(MAGIC) + 1
        self.shares: tuple[int, ...] = tuple(buffer[base : base + count])
        self._busy_at = base + count
        self._depth = 0
        self.applied = 0
        self.borrowed = 0

    @property
    def own(self) -> int:
        """This participant's own threads (its share)."""
        return self.shares[self.slot]

    @classmethod
    def create(cls, shares: Sequence[int], directory: str | None = None) -> CoreShare:
        """A new ledger for ``len(shares)`` participants, owned by this process (slot 0, idle).
        The other slots start busy: their shares are lent only once their process attaches.

        Raises:
            ValueError: no participant, more than 255, or a share outside 1..255 (named).
        """
        if not 1 <= len(shares) <= MAX_PARTICIPANTS:
            raise ValueError(f"CoreShare needs 1 to {MAX_PARTICIPANTS} participants; got {len(shares)}.")
        bad = [s for s in shares if not 1 <= int(s) <= 255]
        if bad:
            raise ValueError(f"CoreShare shares are thread counts from 1 to 255; got {list(shares)}.")
        path = os.path.join(directory or _directory(), f"trellis-cores-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        data = MAGIC + bytes([len(shares), *map(int, shares)]) + bytes([0] + [1] * (len(shares) - 1))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
            buffer = mmap.mmap(fd, len(data))
        finally:
            os.close(fd)
        return cls(path, 0, buffer, owner=True)

    @classmethod
    def attach(cls, path: str, slot: int) -> CoreShare:
        """Join the ledger at ``path`` as participant ``slot``, which starts idle.

        Raises:
            ValueError: ``path`` is no ledger, or ``slot`` is not one of its participants (named).
            OSError: ``path`` cannot be opened.
        """
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < len(MAGIC) + 1:
                raise ValueError(f"{path} is not a Trellis core ledger (it has {size} bytes).")
            buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        count = buffer[len(MAGIC)]
        if buffer[: len(MAGIC)] != MAGIC or size != len(MAGIC) + 1 + 2 * count:
            buffer.close()
            raise ValueError(f"{path} is not a Trellis core ledger (bad header or size).")
        if not 0 < slot < count:
            buffer.close()
            raise ValueError(
                f"Core ledger {path} has participants 0..{count - 1}; slot {slot} is not one to attach."
            )
        share = cls(path, slot, buffer, owner=False)
        share._mark(False)
        return share

    def _mark(self, busy: bool) -> None:
        self._map[self._busy_at + self.slot] = 1 if busy else 0

    def others_busy(self) -> list[bool]:
        """Every other participant's state, by slot (this one's own entry left out)."""
        return [bool(self._map[self._busy_at + i]) for i in range(len(self.shares)) if i != self.slot]

    def threads(self) -> int:
        """The threads this participant may run now: its own share plus the shares of those idle."""
        lent = sum(
            share
            for i, share in enumerate(self.shares)
            if i != self.slot and not self._map[self._busy_at + i]
        )
        return self.own + lent

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Mark this participant computing for the block (nested blocks count once); idle after it."""
        if self._depth == 0:
            self._mark(True)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._mark(False)

    def apply(self) -> int:
        """Set this thread's torch intra-op threads to :meth:`threads` (only when it changed) and count
        the call; the count set."""
        import torch

        n = self.threads()
        self.applied += 1
        self.borrowed += n > self.own
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        return n

    def take_counts(self) -> tuple[int, int]:
        """``(applied, borrowed)`` since the last call, then both reset."""
        counts = (self.applied, self.borrowed)
        self.applied = self.borrowed = 0
        return counts

    def close(self) -> None:
        """Leave the ledger: this slot is marked busy again (a participant that left lends nothing) and,
        for the owner, the file is removed. Safe to call twice."""
        if self._map.closed:
            return
        self._mark(True)
        self._map.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
