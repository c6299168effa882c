"""trellis.algorithms.masked: statistics that ignore everything outside the mask."""

from __future__ import annotations

import pytest
import torch

from trellis.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten

VALUES = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), 5.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 1]])


def test_sum_and_mean_ignore_masked_out_nan_and_inf():
    assert masked_sum(VALUES, MASK).item() == 11.0
    assert masked_mean(VALUES, MASK).item() == 2.75
    assert masked_mean(VALUES, MASK, axis=1).tolist() == [1.5, 4.0]
    assert masked_sum(VALUES, MASK, axis=0).tolist() == [4.0, 2.0, 5.0]


def test_mean_of_an_empty_row_is_zero():
    assert masked_mean(torch.ones(2, 2), torch.tensor([[1, 1], [0, 0]]), axis=1).tolist() == [1.0, 0.0]


def test_variance_matches_torch_on_the_selected_entries():
    selected = torch.tensor([1.0, 2.0, 3.0, 5.0])
    assert masked_var(VALUES, MASK).item() == pytest.approx(selected.var(unbiased=True).item(), abs=1e-6)
    assert masked_var(VALUES, MASK, unbiased=False).item() == pytest.approx(
        selected.var(unbiased=False).item(), abs=1e-6
    )
    assert masked_var(torch.tensor([4.0, 9.0]), torch.tensor([0, 1])).item() == 0.0
    with pytest.raises(ValueError, match="the mask selects no entries"):
        masked_var(VALUES, torch.zeros_like(MASK))


def test_whiten_gives_zero_mean_unit_variance_over_the_mask():
    torch.manual_seed(0)
    values, mask = torch.randn(4, 7) * 3 + 2, (torch.rand(4, 7) > 0.3).long()
    whitened = masked_whiten(values, mask)
    assert abs(masked_mean(whitened, mask).item()) < 1e-6
    assert masked_var(whitened, mask).item() == pytest.approx(1.0, abs=1e-5)
    scaled = masked_whiten(values, mask, shift_mean=False)
    assert masked_mean(scaled, mask).item() == pytest.approx(masked_mean(values, mask).item(), abs=1e-5)
