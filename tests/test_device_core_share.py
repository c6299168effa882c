"""``trellis.device.core_share``: the ledger of a machine's cores, lent by idle processes of a run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from trellis.device.core_share import MAGIC, CoreShare


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


@pytest.fixture
def ledger(tmp_path):
    owner = CoreShare.create([2, 1, 1], directory=str(tmp_path))
    yield owner
    owner.close()


def test_a_busy_participant_runs_its_share_plus_those_of_the_idle(ledger):
    assert (ledger.slot, ledger.shares, ledger.own) == (0, (2, 1, 1), 2)
    # the replicas' slots start busy: nothing is lent by a process that has not attached
    assert ledger.others_busy() == [True, True]
    assert ledger.threads() == 2
    first = CoreShare.attach(ledger.path, 1)
    try:
        assert ledger.others_busy() == [False, True]  # attaching marks the slot idle
        assert ledger.threads() == 3
        assert first.threads() == 1 + 2  # the owner is idle too
        with first.busy():
            assert ledger.threads() == 2
            with first.busy():  # nested: still busy once
                pass
            assert ledger.others_busy() == [True, True]
        assert ledger.threads() == 3
        with ledger.busy():
            assert first.threads() == 1
        assert first.threads() == 3
    finally:
        first.close()
    assert ledger.others_busy() == [True, True]  # a participant that left lends nothing
    assert ledger.threads() == 2


def test_apply_sets_the_threads_and_counts_the_borrowed_calls(ledger):
    replica = CoreShare.attach(ledger.path, 2)
    try:
        assert ledger.apply() == 3  # slot 2 idle, slot 1 never attached
        assert torch.get_num_threads() == 3
        with replica.busy():
            assert ledger.apply() == 2
            assert torch.get_num_threads() == 2
        assert ledger.take_counts() == (2, 1)
        assert ledger.take_counts() == (0, 0)
    finally:
        replica.close()


def test_the_owner_removes_the_file_and_close_is_idempotent(tmp_path):
    owner = CoreShare.create([1, 1], directory=str(tmp_path))
    assert os.path.dirname(owner.path) == str(tmp_path)
    with open(owner.path, "rb") as f:
        assert f.read() == MAGIC + bytes([2, 1, 1, 0, 1])
    replica = CoreShare.attach(owner.path, 1)
    replica.close()
    replica.close()
    assert os.path.exists(owner.path)  # only the owner removes it
    owner.close()
    owner.close()
    assert not os.path.exists(owner.path)


def test_bad_ledgers_slots_and_shares_are_refused_by_name(tmp_path, ledger):
    with pytest.raises(ValueError, match=r"participants 0\.\.2; slot 3"):
        CoreShare.attach(ledger.path, 3)
    with pytest.raises(ValueError, match="slot 0 is not one to attach"):
        CoreShare.attach(ledger.path, 0)
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a ledger at all")
    with pytest.raises(ValueError, match="is not a Trellis core ledger"):
        CoreShare.attach(str(junk), 1)
    with pytest.raises(FileNotFoundError):
        CoreShare.attach(str(tmp_path / "missing"), 1)
    with pytest.raises(ValueError, match="1 to 255 participants; got 0"):
        CoreShare.create([])
    with pytest.raises(ValueError, match=r"from 1 to 255; got \[1, 0\]"):
        CoreShare.create([1, 0], directory=str(tmp_path))


def test_another_process_sees_and_lends_through_the_file(ledger):
    child = (
        "import sys, time\n"
        "from trellis.device.core_share import CoreShare\n"
        "share = CoreShare.attach(sys.argv[1], 1)\n"
        "with share.busy():\n"
        "    print('busy', share.threads(), flush=True)\n"
        "    sys.stdin.readline()\n"
        "print('idle', flush=True)\n"
        "sys.stdin.readline()\n"
        "share.close()\n"
    )
    with ledger.busy():
        proc = subprocess.Popen(
            [sys.executable, "-c", child, ledger.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout.readline().split() == ["busy", "1"]  # the owner computes: no loan
            assert ledger.others_busy() == [True, True]
        finally:
            proc.stdin.write("\n")
            proc.stdin.flush()
    try:
        assert proc.stdout.readline().strip() == "idle"
        assert ledger.others_busy() == [False, True]
        assert ledger.threads() == 2 + 1
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    assert ledger.others_busy() == [True, True]
