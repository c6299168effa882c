"""trellis.trainer.plot: reward_curve.png, drawn without touching matplotlib's global state."""

from __future__ import annotations

import struct

from trellis.trainer.plot import plot_reward_curve


def test_draws_the_curves_into_a_png(tmp_path):
    path = str(tmp_path / "reward_curve.png")
    assert plot_reward_curve(path, [(1, 0.1), (2, None), (3, 0.4)], [(0, 0.0), (3, 1.0)]) == path
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", head[16:24]) == (700, 400)  # 7 x 4 inches at 100 dpi


def test_nothing_to_draw(tmp_path):
    path = tmp_path / "reward_curve.png"
    assert plot_reward_curve(str(path), [(1, None)], [(0, None)]) is None
    assert not path.exists()


def test_the_backend_and_pyplot_are_left_alone(python, tmp_path):
    # a library must not switch the backend a notebook chose, nor import pyplot (~0.15 s) to draw a file
    done = python(
        "import sys, matplotlib\n"
        "matplotlib.use('svg')\n"
        "from trellis.trainer.plot import plot_reward_curve\n"
        f"plot_reward_curve({str(tmp_path / 'curve.png')!r}, [(1, 0.5), (2, 0.7)], [])\n"
        "print(matplotlib.get_backend(), 'matplotlib.pyplot' in sys.modules)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["svg", "False"]
    assert (tmp_path / "curve.png").stat().st_size > 0
