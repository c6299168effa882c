"""The demo: SmolLM2-135M-Instruct learns short arithmetic word problems with GRPO, on a CPU.

    python -m trellis.trainer.demo [key=value ...]     # or: trellis train --preset demo

The task is generated here, on the fly and seeded: one-step word problems (add, take away,
multiply) such as "Mia has 7 marbles and gets 5 more. How many marbles does Mia have now? Answer
with the number only.", scored by the built-in ``arithmetic`` reward (1 when the last integer of
the response is the answer, else 0). Responses are capped at 16 tokens, so the model must answer
briefly: out of the box SmolLM2-135M-Instruct (greedy) restates the problem at length and is cut
off before its answer, or gets the sum wrong, on over 95% of the held-out problems. GRPO teaches
it to write one short equation and stop ("Zoe has 3 + 2 = 5"), and to get more of them right.

The held-out problems use operand pairs that no training problem uses. The trainer's greedy
validations before the first step and after the last measure the held-out accuracy;
:func:`main` prints both, the gain, the wall time and the path of the reward curve.

Measured on 2 cores (x86-64 with AMX, torch 2.13): 40 steps of about 13 s (generation 4 s, update
9 s), 9 minutes in all with model loading and both validations; held-out accuracy went from 3.5%
to 54.0% (``trainer.seed=1``, the default) and to 57.5% (``trainer.seed=2``). Peak memory is about
13 GB. With another busy process on the same two cores, two torch threads slow down several-fold.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DATA_SOURCE = "arithmetic"
"""The ``data_source`` of every problem: the built-in ``arithmetic`` reward scores it."""

INSTRUCTION = "Answer with the number only."

NAMES = ("Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Emma", "Leo", "Zoe", "Noah", "Ava")
ITEMS = ("apples", "books", "coins", "marbles", "pencils", "stickers", "cookies", "cards", "shells", "stamps")

TEMPLATES: dict[str, tuple[str, ...]] = {
    "add": (
        "{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
        "There are {a} {item} in a box. {name} puts {b} more {item} in the box. How many {item} are in "
        "the box now?",
    ),
    "sub": (
        "{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?",
        "There are {a} {item} on the table. {name} takes {b} of them. How many {item} are left on the table?",
    ),
    "mul": (
        "{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have?",
        "{name} buys {a} packs of {item}. Each pack holds {b} {item}. How many {item} does {name} buy?",
    ),
}
"""Question templates per kind of problem; ``{a}`` and ``{b}`` are the operands."""

KINDS = tuple(TEMPLATES)


@dataclass(frozen=True)
class Problem:
    """One word problem: its question (instruction included), its answer, and what it computes."""

    question: str
    answer: int
    kind: str
    a: int
    b: int

    @property
    def key(self) -> tuple[str, int, int]:
        """``(kind, a, b)``: problems with the same key are the same sum, however they are worded."""
        return (self.kind, self.a, self.b)

    def row(self) -> dict[str, Any]:
        """The problem as a dataset row: chat prompt, ``data_source``, ``reward_model.ground_truth``."""
        return {
            "prompt": [{"role": "user", "content": self.question}],
            "data_source": DATA_SOURCE,
            "reward_model": {"ground_truth": str(self.answer)},
        }


def all_keys() -> list[tuple[str, int, int]]:
    """Every ``(kind, a, b)`` the generator uses: ``a + b`` (1..20 each), ``a - b`` (0 < b < a <= 30),
    ``a * b`` (2..9 each)."""
    add = [("add", a, b) for a in range(1, 21) for b in range(1, 21)]
    sub = [("sub", a, b) for a in range(2, 31) for b in range(1, a)]
    mul = [("mul", a, b) for a in range(2, 10) for b in range(2, 10)]
    return add + sub + mul


def _answer(kind: str, a: int, b: int) -> int:
    return {"add": a + b, "sub": a - b, "mul": a * b}[kind]


def make_problem(kind: str, a: int, b: int, rng: random.Random) -> Problem:
    """The problem ``a <op> b`` of ``kind`` (``add``, ``sub`` or ``mul``), worded with ``rng``'s choices.

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in TEMPLATES:
        raise ValueError(f"Unknown kind of problem {kind!r}; kinds: {', '.join(KINDS)}.")
    template = rng.choice(TEMPLATES[kind])
    text = template.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
    return Problem(f"{text} {INSTRUCTION}", _answer(kind, a, b), kind, a, b)


def make_problems(
    n_train: int = 1024, n_heldout: int = 200, seed: int = 0
) -> tuple[list[Problem], list[Problem]]:
    """Training and held-out problems, the same for the same arguments.

    Held-out problems are distinct sums, drawn uniformly from :func:`all_keys`; no training problem
    computes any of them, so held-out accuracy is not recall of a sum seen in training. Training
    problems are drawn uniformly from the other sums (a sum may repeat, worded differently).

    Raises:
        ValueError: ``n_heldout`` is over half of all sums (too few would be left to train on).
    """
    keys = all_keys()
    if not 0 <= n_heldout <= len(keys) // 2:
        raise ValueError(f"n_heldout must be between 0 and {len(keys) // 2}, got {n_heldout}.")
    rng = random.Random(seed)
    held = rng.sample(keys, n_heldout)
    heldout = [make_problem(kind, a, b, rng) for kind, a, b in held]
    taken = set(held)
    remaining = [key for key in keys if key not in taken]
    train = [make_problem(*rng.choice(remaining), rng) for _ in range(n_train)]
    return train, heldout


def heldout_accuracy(validation: Sequence[tuple[int, dict[str, float]]]) -> tuple[float, float]:
    """``(before, after)``: held-out accuracy of the first and the last validation, in [0, 1].

    Validations are greedy with one response per problem, and the reward is 0 or 1, so the mean
    reward is the fraction of problems answered right (``val/pass@1``).

    Raises:
        ValueError: fewer than two validations (the run must validate before and after training).
    """
    if len(validation) < 2:
        raise ValueError(
            f"Need validations before and after training, got {len(validation)}; keep "
            "trainer.val_before_train true and trainer.test_freq > 0."
        )
    return validation[0][1]["val/pass@1"], validation[-1][1]["val/pass@1"]


def run(overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Train the ``demo`` preset (with ``overrides`` on top); returns a summary.

    Returns:
        ``{"before", "after"}`` held-out accuracy (fractions), ``"heldout"`` (number of
        problems), ``"steps"``, ``"seconds"`` (wall time, model preparation included),
        ``"reward_curve"`` and ``"run_dir"`` (paths), and ``"result"`` (the ``TrainResult``).
    """
    import trellis
    from trellis.config import load_config
    from trellis.data.dataset import read_rows
    from trellis.trainer.presets import preset_overrides

    start = time.perf_counter()
    config = load_config(None, [*preset_overrides("demo"), *overrides])
    result = trellis.train(config)
    seconds = time.perf_counter() - start
    before, after = heldout_accuracy(result.validation)
    return {
        "before": before,
        "after": after,
        "heldout": sum(len(read_rows(path)) for path in config.data.val_files),
        "steps": result.steps,
        "seconds": seconds,
        "reward_curve": result.reward_curve,
        "run_dir": result.run_dir,
        "result": result,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The lines :func:`main` prints: accuracy before and after, gain, wall time, reward curve."""
    before, after = 100 * summary["before"], 100 * summary["after"]
    count = f" ({summary['heldout']} problems)" if summary.get("heldout") else ""
    minutes, seconds = divmod(round(summary["seconds"]), 60)
    return "\n".join(
        [
            f"Held-out accuracy{count}, greedy:",
            f"  before training: {before:5.1f}%",
            f"  after {summary['steps']} GRPO steps: {after:5.1f}%",
            f"  gain: {after - before:+.1f} points",
            f"Wall time: {minutes} min {seconds:02d} s",
            f"Reward curve: {summary['reward_curve'] or 'none'}",
            f"Run directory: {summary['run_dir']}",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trellis.trainer.demo [key=value ...]``: run the demo and print its summary."""
    parser = argparse.ArgumentParser(
        prog="python -m trellis.trainer.demo",
        description="GRPO on SmolLM2-135M-Instruct with generated arithmetic word problems (CPU, ~10 min).",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides on the preset")
    args = parser.parse_args(argv)
    print(
        "Trellis demo: SmolLM2-135M-Instruct learns arithmetic word problems with GRPO.\n"
        f"Example problem: {make_problems(1, 0)[0][0].question}",
        flush=True,
    )
    summary = run(args.overrides)
    print(format_summary(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
