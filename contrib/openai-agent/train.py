"""Train the agent of ``agent.py`` (the real ``openai`` SDK) with GRPO on the tiny model, on the CPU.

    python contrib/openai-agent/train.py [--steps 10] [--workdir DIR]

The tiny model is first taught to call the calculator (a few seconds of supervised steps, see
:mod:`trellis.recipes.calculator`); RL then teaches it to answer the tool's result in digits, which is
what ``agent.py`` rewards. Prints the reward and the tool calls per step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def train(workdir: str, steps: int = 10, extra: list[str] | None = None) -> Any:
    """Run ``steps`` GRPO steps of the agent in ``workdir``; returns the ``TrainResult``."""
    import trellis
    from trellis.config import load_config
    from trellis.recipes.calculator import prepare_agent_run

    overrides = [
        *prepare_agent_run(workdir),
        f"rollout.agent.function={os.path.join(HERE, 'agent.py')}:run",
        f"trainer.total_training_steps={steps}",
        f"trainer.run_dir={os.path.join(workdir, 'run')}",
        "trainer.trackers=[]",
        *(extra or []),
    ]
    return trellis.train(load_config(overrides=overrides))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--workdir", help="where the model, data and run go (default: a temporary folder)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="trellis-agent-") as tmp:
        result = train(args.workdir or tmp, args.steps)
    for step, metrics in enumerate(result.history, 1):
        print(
            f"step {step}: reward {metrics['reward/mean']:.3f}  tool calls/sample "
            f"{metrics['agent/tool_calls']:.2f}  gateway calls/sample {metrics['gateway/calls']:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
