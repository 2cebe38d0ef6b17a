"""`RequestLimits`: the rules a request must meet, shared by the scheduler and the front end."""

from __future__ import annotations

import pytest

from engine.limits import RequestLimits


def test_strictest_takes_the_tightest_bound_of_every_rank() -> None:
    a = RequestLimits(max_model_len=4096, block_tokens=128, num_blocks=40, max_context_len=None)
    b = RequestLimits(max_model_len=8192, block_tokens=128, num_blocks=32, max_context_len=9000)
    both = RequestLimits.strictest([a, b])
    assert both == RequestLimits(4096, 128, 32, 9000)
    fits_a_only = (4000, 90)  # 4090 tokens: 32 blocks hold 4096, so b's pool holds it too
    assert a.rejection_reason(*fits_a_only) is None and both.rejection_reason(*fits_a_only) is None
    pool_of_b = RequestLimits(8192, 128, 32).rejection_reason(4200, 10)
    assert pool_of_b == (
        "the request may reach 4210 tokens, which needs 33 KV blocks, but the whole cache holds "
        "32 blocks (4096 tokens)"
    )
    with pytest.raises(ValueError, match="same block size"):
        RequestLimits.strictest([a, RequestLimits(4096, 64, 40)])
