"""The README's plugin example works as written."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
import torch

from trellis.registries import advantage_estimators, reward_functions

ROOT = Path(__file__).resolve().parents[1]


def code_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


def test_readme_plugin_example(tmp_path, monkeypatch):
    readme = ROOT / "README.md"
    (toml,) = [b for b in code_blocks(readme, "toml") if "my-trellis-plugin" in b]
    (module,) = [b for b in code_blocks(readme, "python") if b.startswith("# my_plugin.py")]
    entry_points = tomllib.loads(toml)["project"]["entry-points"]
    assert entry_points == {
        "trellis.advantage_estimators": {"signed": "my_plugin:signed_advantage"},
        "trellis.reward_functions": {"exact": "my_plugin:exact"},
    }
    (tmp_path / "my_plugin.py").write_text(module)
    monkeypatch.chdir(tmp_path)

    signed = advantage_estimators.get("./my_plugin.py:signed_advantage")
    rewards = torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages, returns = signed(rewards, mask, index=None, config=None)
    assert advantages.tolist() == [[-1.0, -1.0, 0.0], [1.0, 1.0, 1.0]]
    assert returns is advantages

    exact = reward_functions.get("my_plugin.py:exact")
    assert exact(data_source="x", solution_str=" 12 ", ground_truth=12, extra_info=None) == 1.0
    assert exact(data_source="x", solution_str="13", ground_truth=12) == 0.0
