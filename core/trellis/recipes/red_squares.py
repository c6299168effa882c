"""A synthetic visual task for vision-language RL: "how many red squares?" on generated images.

Each row's image (56x56, white) holds 1 to 3 red squares and some blue ones placed at random; the
prompt asks, through an ``<image>`` placeholder (verl's layout), for the number of red squares as a
digit, and ``reward_model.ground_truth`` holds it. :func:`score` gives 1 for the right digit as the
first character of the answer, 0.2 for another digit (an answer in the asked form) and 0 otherwise.
A policy only reaches 1 by looking at the picture: the blue squares make the count of squares useless.

:func:`prepare_run` writes the tiny VL model (:mod:`trellis.recipes.tiny_vl`) and the data, and returns
the overrides of a GRPO run on them; ``python -m trellis.recipes.red_squares`` runs it.
"""

from __future__ import annotations

import io
import os
import random
from typing import Any

QUESTION = "<image>How many red squares are in the picture? Answer with one digit."
SIZE = 56


def draw(red: int, blue: int, rng: random.Random) -> bytes:
    """A PNG: ``red`` red and ``blue`` blue 10x10 squares on white, not overlapping."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), "white")
    canvas = ImageDraw.Draw(image)
    cells = rng.sample([(x, y) for x in range(4) for y in range(4)], red + blue)
    for i, (x, y) in enumerate(cells):
        left, top = 3 + 13 * x, 3 + 13 * y
        canvas.rectangle([left, top, left + 9, top + 9], fill="red" if i < red else "blue")
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows in verl's geo3k layout: ``images`` as ``[{"bytes": png}]``, the prompt with ``<image>``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        red = rng.randint(1, 3)
        out.append(
            {
                "data_source": "red_squares",
                "prompt": [{"role": "user", "content": QUESTION}],
                "images": [{"bytes": draw(red, rng.randint(0, 3), rng), "path": None}],
                "reward_model": {"style": "rule", "ground_truth": str(red)},
                "extra_info": {"red": red},
            }
        )
    return out


def score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any) -> float:
    """1 for the right digit first, 0.2 for another digit first, else 0."""
    answer = solution_str.strip()[:1]
    if answer == str(ground_truth).strip():
        return 1.0
    return 0.2 if answer.isdigit() else 0.0


def prepare_run(workdir: str, n_rows: int = 64, seed: int = 0) -> list[str]:
    """Write the tiny VL model (``workdir/model``) and parquet data; the overrides of a GRPO run on them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trellis.recipes.tiny_vl import save_tiny_vl_model

    model = save_tiny_vl_model(os.path.join(workdir, "model"), seed=seed)
    train, val = os.path.join(workdir, "train.parquet"), os.path.join(workdir, "val.parquet")
    pq.write_table(pa.Table.from_pylist(rows(n_rows, seed)), train)
    pq.write_table(pa.Table.from_pylist(rows(16, seed + 1)), val)
    return [
        f"model.path={model}",
        "model.dtype=float32",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "data.train_batch_size=8",
        "data.max_prompt_length=64",
        "data.max_response_length=4",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size_per_device=16",
        "actor.optim.lr=3e-2",
        "reward.function=trellis.recipes.red_squares:score",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.resume_mode=disable",
        "trainer.trackers=[]",
    ]


def main() -> None:  # pragma: no cover - a convenience entry point
    import tempfile

    from trellis.config import load_config
    from trellis.trainer.ppo import Trainer

    with tempfile.TemporaryDirectory(prefix="trellis-red-squares-") as tmp:
        overrides = [*prepare_run(tmp), "trainer.total_training_steps=10", f"trainer.run_dir={tmp}/run"]
        for step, metrics in enumerate(Trainer(load_config(overrides=overrides)).fit().history, 1):
            print(f"step {step}: reward {metrics['reward/mean']:.3f}")


if __name__ == "__main__":  # pragma: no cover
    main()
