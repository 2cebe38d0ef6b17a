"""`benchmarks/kernel_census.py`'s rule for which aten ops launch a kernel."""

from __future__ import annotations

from collections import Counter

import torch

from benchmarks.kernel_census import LaunchCensus


def test_copies_count_and_views_do_not() -> None:
    x = torch.randn(4, 8)
    census = LaunchCensus()
    with torch.inference_mode(), census:
        x.bfloat16()  # a dtype conversion: a kernel
        x.float()  # the same dtype: x itself
        x.view(8, 4).t()
        x.reshape(32)  # a view
        x.t().reshape(32)  # a copy
        x.t().contiguous()  # a copy
        x.contiguous()  # x itself
        torch.empty(0).bfloat16()  # nothing to copy
        x.add(1)
    expected = {"aten::to": 1, "aten::reshape": 1, "aten::contiguous": 1, "aten::add": 1}
    assert census.by_op == Counter(expected)
