"""The spawn harness never leaves a rank behind: a failing rank stops the others at once."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from tests.distributed import failing
from tests.distributed.spawn import run_ranks


def test_a_failing_rank_fails_fast_and_no_rank_is_left_behind() -> None:
    before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 failed on purpose"):
        run_ranks(failing.one_rank_raises, 2, deadline_s=100)
    assert time.monotonic() - start < 60  # neither the deadline nor the 120 s collective timeout
    assert set(multiprocessing.active_children()) - before == set()
