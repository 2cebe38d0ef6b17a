"""Rank functions that fail on purpose (spawn-harness tests); imports only torch."""

from __future__ import annotations

import torch.distributed as dist

from engine.distributed.groups import RankConfig, rank_groups


def one_rank_raises(rank: int, world_size: int, port: int) -> None:
    """Rank 1 raises inside a step; rank 0 then waits in a collective that never completes."""
    with rank_groups(RankConfig(rank, world_size, master_port=port, timeout_s=120)):
        if rank == 1:
            raise RuntimeError("rank 1 failed on purpose")
        dist.barrier()
