"""An async trainer run for ``tests/test_async_kill_resume.py``; run from the repository root:

    python tests/trainer_async_run.py RUN_DIR --steps 6

trains the ``tiny`` preset with ``trainer.mode=async`` (one standalone hf replica, max_staleness 1,
stale groups regenerated, partial rollout), checkpointing every step and resuming from the latest
checkpoint (``resume_mode=auto``). Before each step's update it appends the sample ids the step trains
to ``RUN_DIR/trained.jsonl`` (``{"step", "pid", "ids"}``, fsynced), so a test can tell which steps a
killed run trained and which a resumed one trained again. Markers on stdout: ``STEP <step>``,
``SAVED <step>``, ``DONE <steps>``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "core"))
    import torch

    torch.set_num_threads(1)
    from trellis.config import load_config
    from trellis.recipes.presets import preset_overrides
    from trellis.trainer.ppo import Trainer

    log = os.path.join(args.run_dir, "trained.jsonl")

    class Logged(Trainer):
        def train_batch(self, batch, greedy, metrics, timings):
            ids = [str(i) for i in batch.non_tensor_batch["sample_id"]]
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": self.step, "pid": os.getpid(), "ids": ids}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            print(f"STEP {self.step}", flush=True)
            return super().train_batch(batch, greedy, metrics, timings)

        def _save_checkpoint(self):
            path = super()._save_checkpoint()
            print(f"SAVED {self.step}", flush=True)
            return path

    config = load_config(
        overrides=[
            *preset_overrides("tiny"),
            f"trainer.run_dir={args.run_dir}",
            "trainer.trackers=[jsonl]",
            f"trainer.total_training_steps={args.steps}",
            "trainer.save_freq=1",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "trainer.resume_mode=auto",
            "rollout.mode=standalone",
            "trainer.mode=async",
            "rollout.max_staleness=1",
            "rollout.stale_policy=regenerate",
            "rollout.partial_rollout=true",
        ]
    )
    os.makedirs(args.run_dir, exist_ok=True)
    result = Logged(config).fit()
    print(f"DONE {result.steps}", flush=True)


if __name__ == "__main__":
    main()
