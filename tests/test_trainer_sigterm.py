"""SIGTERM (a scheduler's preemption, ``kill``) stops a training run cleanly: the stage in progress is cut
short, the trackers finish, the workers shut down, the run says where it stopped and exits with 143.

The Ray executor's case is in the distributed session (``test_sigterm_stops_a_ray_run_and_its_processes``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from trellis.utils import termination

SLEEPER = textwrap.dedent(
    """
    import os, time

    COUNT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.txt")

    def score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        with open(COUNT, "a") as f:
            f.write("x")
        if os.path.getsize(COUNT) > int(os.environ["SLEEP_AFTER"]):
            time.sleep(3600)  # the SIGTERM must cut this short
        return 0.0
    """
)


def test_sigterm_raises_terminated_in_the_main_thread_even_in_a_blocking_call(python):
    code = textwrap.dedent(
        """
        import os, signal, threading, time
        from trellis.utils import termination as t

        def mine(signum, frame):
            pass

        signal.signal(signal.SIGTERM, mine)
        assert t.arm_sigterm_stop() is True
        assert t.arm_sigterm_stop() is False  # armed once: a second arm does nothing
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        try:
            time.sleep(30)
        except t.Terminated as exc:
            print("terminated", exc.code, isinstance(exc, SystemExit), round(time.monotonic() - start))
        print("received", t.sigterm_received())
        print("during the shutdown", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
        t.disarm_sigterm_stop()
        print("put back", signal.getsignal(signal.SIGTERM) is mine)
        t.disarm_sigterm_stop()  # a second disarm does nothing
        print("still", signal.getsignal(signal.SIGTERM) is mine)
        """
    )
    proc = python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:5] == [
        "terminated 143 True 0",  # cut short at once, not after the 30 s sleep
        "received True",
        "during the shutdown True",  # a second SIGTERM before the shutdown ends the process at once
        "put back True",
        "still True",
    ]


def test_an_uncaught_terminated_exits_143_without_a_traceback(python):
    code = "import os, signal\nfrom trellis.utils import termination as t\nt.arm_sigterm_stop()\n"
    code += "os.kill(os.getpid(), signal.SIGTERM)\nimport time; time.sleep(30)\n"
    proc = python(code)
    assert proc.returncode == 143 == termination.EXIT_CODE
    assert "Traceback" not in proc.stderr, proc.stderr


def test_arming_leaves_an_ignored_sigterm_ignored_and_does_nothing_off_the_main_thread():
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        assert termination.arm_sigterm_stop() is False  # whoever started the process chose to ignore it
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        termination.disarm_sigterm_stop()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.append(termination.arm_sigterm_stop()))
    thread.start()
    thread.join()
    assert results == [False] and signal.getsignal(signal.SIGTERM) == before


def _start(
    tmp_path, command, *overrides, sleep_after: int, executor: str = "local", ignore_sigint: bool = False
) -> subprocess.Popen[str]:
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    cmd = command(
        f"{tmp_path / 'sleeper.py'}:score",
        "reward.timeout_seconds=3600",
        f"trainer.executor={executor}",
        "trainer.total_training_steps=50",
        "trainer.save_freq=1",
        "trainer.trackers=[console,jsonl]",
        *overrides,
    )
    env = {
        **os.environ,
        "SLEEP_AFTER": str(sleep_after),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    # ignore_sigint: started as a background job is, with SIGINT ignored
    preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=preexec,
    )


def _terminate_while_scoring(proc: subprocess.Popen[str], tmp_path, calls: int) -> tuple[str, str, float]:
    """Wait until the reward function sleeps (its ``calls``-th call has started), send SIGTERM; returns
    the run's stdout, stderr and the seconds from the signal to its exit."""
    count = tmp_path / "calls.txt"
    deadline = time.monotonic() + 240
    while not (count.exists() and count.stat().st_size > calls):
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate(timeout=30)
            pytest.fail(
                f"the run never reached the sleeping reward call (exit {proc.returncode}):\n{err[-3000:]}"
            )
        time.sleep(0.1)
    time.sleep(0.5)  # inside time.sleep(3600) by now
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the run did not stop within 90 s of SIGTERM:\n{err[-3000:]}")
    return out, err, time.monotonic() - sent


def test_sigterm_stops_a_run_cleanly_where_it_is_and_keeps_its_last_checkpoint(tmp_path, tiny_train_command):
    """The reward function sleeps in step 4 (after the 3 x 32 calls of steps 1-3)."""
    proc = _start(tmp_path, tiny_train_command, sleep_after=96)
    _, err, seconds = _terminate_while_scoring(proc, tmp_path, 96)
    assert proc.returncode == 143, err[-3000:]
    assert seconds < 30, seconds  # the sleeping call was cut short (it sleeps an hour)
    assert "Traceback" not in err, err[-3000:]
    run = tmp_path / "run"
    stopped = re.search(
        r"Stopped by SIGTERM in step (\d+) \((\d+) of 50 steps finished, their metrics in (\S+)\)", err
    )
    assert stopped is not None, err[-3000:]
    assert (stopped[1], stopped[2], stopped[3]) == ("4", "3", str(run))
    assert f"the last checkpoint is {run / 'checkpoints' / 'global_step_3'}; trainer.resume_mode=auto" in err
    assert "Run summary" in err  # the console tracker (on stderr) finished its run
    steps = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"timing/step"' in line]
    assert len(steps) == 3
    from trellis.checkpoint.training import CheckpointManager, verify_checkpoint

    latest = CheckpointManager(str(run / "checkpoints")).latest()
    assert latest is not None and latest.endswith("global_step_3")
    verify_checkpoint(latest)


def test_without_a_checkpoint_the_message_says_a_new_run_starts_over(tmp_path, tiny_train_command):
    proc = _start(tmp_path, tiny_train_command, "trainer.save_freq=-1", sleep_after=32)
    _, err, _ = _terminate_while_scoring(proc, tmp_path, 32)
    assert proc.returncode == 143, err[-3000:]
    assert "Stopped by SIGTERM in step 2 (1 of 50 steps finished" in err, err[-3000:]
    assert "no checkpoint was saved (trainer.save_freq), so a new run starts from step 0." in err


@pytest.mark.distributed  # a Ray cluster of its own, about 40 s on 2 cores
def test_sigterm_stops_a_ray_run_and_its_processes(tmp_path, tiny_train_command):
    proc = _start(tmp_path, tiny_train_command, sleep_after=64, executor="ray")
    _, err, seconds = _terminate_while_scoring(proc, tmp_path, 64)
    assert proc.returncode == 143, err[-3000:]
    assert "Stopped by SIGTERM in step 3 (2 of 50 steps finished" in err, err[-3000:]
    assert seconds < 60, seconds
    assert "After SIGTERM the workers are killed without releasing their rollout replicas first" in err
    assert "SIGTERM received at time" not in err  # Ray's native handler (a stack dump) no longer answers
    time.sleep(2)
    # the driver led its own session: nothing it started (raylet, GCS, the worker actors) is left in it
    left = subprocess.run(["ps", "-o", "pid=,args=", "-s", str(proc.pid)], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


def test_a_shutdown_cut_short_after_sigterm_is_said_and_the_stop_still_raised(caplog):
    from trellis.trainer.ppo import Trainer, TrainResult

    trainer = Trainer.__new__(Trainer)  # only what the stop reads
    trainer.step, trainer.total_steps, trainer.run_dir = 5, 10, "/runs/x"

    def shutdown_raising_the_stop_again():  # as a part that kept the SIGTERM's exception would
        raise termination.Terminated

    trainer._shutdown = shutdown_raising_the_stop_again
    with (
        caplog.at_level("WARNING", logger="trellis.trainer.ppo"),
        pytest.raises(termination.Terminated) as stop,
    ):
        trainer._shutdown_after_sigterm(TrainResult(run_dir="/runs/x"), finished=4)
    assert stop.value.code == 143
    assert "The shutdown after SIGTERM was cut short." in caplog.text
    assert (
        "Stopped by SIGTERM in step 5 (4 of 10 steps finished, their metrics in /runs/x); the trackers were "
        "finished and the shutdown was cut short (Terminated), so a process it started may be left; no "
        "checkpoint was saved (trainer.save_freq), so a new run starts from step 0." in caplog.text
    )


def test_sigterm_mid_step_stops_cleanly_wherever_it_lands(tmp_path, tiny_train_command):
    """No sleeping stage: the signal lands wherever the run is, mostly in generation or the update. Started
    with SIGINT ignored (as a background job), this run failed 4 times in 4 before the hf replica's
    shutdown stopped raising again the exception its batch loop had ended with: the shutdown was cut short
    and the run exited 143 without saying where it stopped."""
    proc = _start(tmp_path, tiny_train_command, "trainer.save_freq=-1", sleep_after=10**9, ignore_sigint=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 143, err[-3000:]
    assert "the trackers were finished and the workers shut down; no checkpoint was saved" in err, err[-3000:]
    assert "Traceback" not in err and "cut short" not in err, err[-3000:]
