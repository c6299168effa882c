"""No silent hang: every stage of a step has a deadline (trainer.stage_timeout_s / stage_timeouts);
past it the run reports the stage and the Python stacks, stops with exit code 3 and keeps its last
checkpoint. A hanging reward function is said at once, not after the whole batch.

The Ray executor's cases (a worker SIGKILLed mid-step, a worker stalled) are in
``tests/test_trainer_stall_ray.py`` (the distributed session)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from trellis.utils.watchdog import StageWatchdog, interrupt_main_thread, tail, thread_stacks

HANG = textwrap.dedent(
    """
    import os, time

    COUNT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.txt")

    def score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        with open(COUNT, "a") as f:
            f.write("x")
        if os.path.getsize(COUNT) > int(os.environ.get("HANG_AFTER", "0")):
            time.sleep(3600)  # stuck: the stage deadline must end the run
        return 0.0
    """
)


def test_the_watchdog_fires_once_per_stage_past_its_deadline():
    fired: list[tuple[str, float, float]] = []
    dog = StageWatchdog(
        0.2, {"slow": 0.5, "free": None, "step": 0.3}, lambda *a: fired.append(a), exempt=("step",)
    )
    assert (dog.limit("any"), dog.limit("slow"), dog.limit("free"), dog.limit("step")) == (
        0.2,
        0.5,
        None,
        0.3,
    )
    assert StageWatchdog(None, {}, lambda *a: None).limit("any") is None
    with dog.stage("quick"):
        time.sleep(0.05)
    with dog.stage("free"):
        time.sleep(0.3)  # no deadline
    with dog.stage("score"):
        time.sleep(0.5)
    time.sleep(0.1)
    assert [f[0] for f in fired] == ["score"]
    _, elapsed, limit = fired[0]
    assert limit == 0.2 and 0.2 <= elapsed < 0.45
    dog.close()
    with dog.stage("score"):  # closed: no deadline any more
        time.sleep(0.3)
    assert len(fired) == 1


def test_thread_stacks_and_tail_read_where_the_process_is(tmp_path):
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="waiter", daemon=True)
    thread.start()
    try:
        stacks = thread_stacks()
    finally:
        stop.set()
    assert 'Thread "waiter"' in stacks and "in wait" in stacks
    assert "test_thread_stacks_and_tail_read_where_the_process_is" in stacks
    log = tmp_path / "log.txt"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert tail(str(log), 3) == "line 97\nline 98\nline 99" and tail(str(tmp_path / "none"), 3) == ""


def _interrupted_sleep() -> tuple[list[str], float]:
    """Sleep 30 s in the main thread while a timer thread calls :func:`interrupt_main_thread` after
    0.2 s: how it sent the interrupt, and how long the sleep lasted."""
    how: list[str] = []
    threading.Timer(0.2, lambda: how.append(interrupt_main_thread())).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        time.sleep(30)
    return how, time.monotonic() - started


def test_the_interrupt_cuts_short_a_blocking_call_of_the_main_thread():
    """A stalled stage usually waits in C (a sleep, a lock, a socket): the interrupt must wake it, not
    just set a flag for when Python code runs again (``_thread.interrupt_main`` alone), and also where
    SIGINT is ignored, as a process started in the background inherits it."""
    from trellis.utils.watchdog import WAKE_SIGNAL, arm_main_thread_wake, disarm_main_thread_wake

    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        how, seconds = _interrupted_sleep()  # not armed: SIGINT, which Python handles
        assert how == ["sigint"] and seconds < 5
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert interrupt_main_thread() == "flag"  # ignored, not armed: nothing reaches the thread
        time.sleep(0.05)
        before = signal.getsignal(WAKE_SIGNAL)
        assert arm_main_thread_wake() is True
        try:
            how, seconds = _interrupted_sleep()
        finally:
            disarm_main_thread_wake()
        assert how == ["wake"] and seconds < 5
        assert signal.getsignal(WAKE_SIGNAL) == before  # the former handler is back
        assert interrupt_main_thread() == "flag"  # disarmed: no wake signal is sent any more
        time.sleep(0.05)
    finally:
        signal.signal(signal.SIGINT, previous)


def _train(tmp_path, command, *overrides, hang_after=0, timeout=240, ignore_sigint=False):
    (tmp_path / "hang.py").write_text(HANG)
    cmd = command(f"{tmp_path / 'hang.py'}:score", "reward.timeout_seconds=600", *overrides)
    env = {
        **os.environ,
        "HANG_AFTER": str(hang_after),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    started = time.monotonic()
    # ignore_sigint: the run starts as a background job would, with SIGINT ignored
    preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec)
    return proc, time.monotonic() - started


def test_a_stalled_stage_is_reported_with_its_stacks_and_the_run_stops_with_code_3(
    tmp_path, tiny_train_command
):
    """The reward function hangs in step 2 (after the 32 calls of step 1); step 1's checkpoint stays."""
    proc, seconds = _train(
        tmp_path,
        tiny_train_command,
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        "trainer.stage_timeouts={score: 4}",
        hang_after=32,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert (
        "Stage 'score' of step 2 has run 4 s, past its deadline of 4 s (trainer.stage_timeouts.score)"
        in proc.stderr
    )
    report = (tmp_path / "run" / "stall_report.txt").read_text()
    assert "== this process (driver) ==" in report
    assert "hang.py" in report and "time.sleep(3600)" in report  # where it is stuck
    # the interrupt reached the sleeping reward call: the run shut down by itself, not by the last
    # resort that exits STALL_GRACE_S (30 s) after the report
    assert "did not stop within" not in proc.stderr, proc.stderr[-3000:]
    assert "trellis: error: Stage 'score' of step 2" in proc.stderr
    assert seconds < 120  # the first step, then 4 s of stall, then shutdown
    from trellis.checkpoint.training import CheckpointManager, verify_checkpoint

    latest = CheckpointManager(str(tmp_path / "run" / "checkpoints")).latest()
    assert latest is not None and latest.endswith("global_step_1")
    verify_checkpoint(latest)


def test_stage_timeout_s_applies_to_every_stage_and_null_turns_it_off(tmp_path, tiny_train_command):
    proc, _ = _train(
        tmp_path,
        tiny_train_command,
        "trainer.total_training_steps=1",
        "trainer.stage_timeout_s=3",
        ignore_sigint=True,
    )
    assert (
        proc.returncode == 3
        and "Stage 'score' of step 1" in proc.stderr
        and "(trainer.stage_timeout_s)" in proc.stderr
        and "did not stop within" not in proc.stderr
    )
    ok, _ = _train(
        tmp_path,
        tiny_train_command,
        "trainer.total_training_steps=1",
        "trainer.stage_timeout_s=null",
        hang_after=10_000,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_a_hanging_reward_call_is_said_at_once(tmp_path, caplog):
    from trellis.reward.managers import NaiveRewardManager

    (tmp_path / "hang.py").write_text(HANG.replace("time.sleep(3600)", "time.sleep(5)"))
    manager = NaiveRewardManager(None, f"{tmp_path / 'hang.py'}:score", timeout_seconds=0.5)
    samples = [{"data_source": "x", "solution_str": "1", "ground_truth": "1", "extra_info": None}] * 2
    with caplog.at_level("WARNING"):
        started = time.monotonic()
        outcomes = manager._score(samples)
    assert [o.timed_out for o in outcomes] == [True, True] and time.monotonic() - started < 3
    assert "A reward call timed out after 0.5 s (sample 1 of 2" in caplog.text


@pytest.mark.parametrize("key", ["trainer.stage_timeout_s", "trainer.stage_timeouts"])
def test_the_deadline_settings_reach_the_watchdog(key, tiny_model_path):
    from trellis.config import load_config
    from trellis.trainer.ppo import Trainer

    override = f"{key}=7" if key.endswith("_s") else f"{key}={{generate: 9, score: null}}"
    trainer = Trainer(load_config(None, [f"model.path={tiny_model_path}", override]))
    dog = trainer.watchdog
    if key.endswith("_s"):
        assert dog.limit("generate") == 7.0 and dog.limit("step") is None
    else:
        assert (
            dog.limit("generate") == 9.0
            and dog.limit("score") is None
            and dog.limit("update_actor") == 3600.0
        )
