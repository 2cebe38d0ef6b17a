"""Process-group setup for the engine ranks (`scaleout.md` §2.1).

One process per device. `init_groups(config)` initialises torch.distributed with the backend of
the device type (`BACKENDS`: gloo on CPU, NCCL on CUDA) and returns the groups every rank uses:

    world   all ranks of the engine (default group)
    ep      the MoE collectives (the device backend; today the whole world)
    cpu     gloo over the same ranks: control metadata (the step coordinator's all-gather),
            so host-side agreement never waits behind device collectives

`RankConfig.from_env()` reads torch's launcher variables (through `engine.envs`); explicit
values (`RankConfig(rank, world_size, master_addr, master_port)`) serve spawned test ranks.
Always pair `init_groups` with `destroy_groups` (or use `rank_groups` as a context manager).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine import envs

BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl"}
DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RankConfig:
    """Where this rank sits in the engine and how ranks meet.

    rank / world_size: torch's global rank and process count (all nodes together).
    master_addr / master_port: the TCP rendezvous of rank 0.
    device_type: "cpu" or "cuda" (chooses the backend, `BACKENDS`).
    local_rank: the device index on this node (CUDA: `cuda:{local_rank}`).
    timeout_s: how long a collective may wait for a missing rank before raising.
    """

    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    device_type: str = "cpu"
    local_rank: int = 0
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside [0, {self.world_size})")
        if self.device_type not in BACKENDS:
            raise ValueError(
                f"unknown device type {self.device_type!r}; choose one of {', '.join(BACKENDS)}"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")

    @property
    def backend(self) -> str:
        return BACKENDS[self.device_type]

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @classmethod
    def from_env(cls, device_type: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> RankConfig:
        """From `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` (torchrun's
        names); a missing `RANK`/`WORLD_SIZE` means a single rank."""
        env = envs.torch_distributed()
        return cls(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
            device_type=device_type,
            local_rank=int(env.get("LOCAL_RANK", 0)),
            timeout_s=timeout_s,
        )


@dataclass(frozen=True)
class RankGroups:
    """The process groups of one rank (see the module docstring)."""

    config: RankConfig
    ep: dist.ProcessGroup
    cpu: dist.ProcessGroup

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size


def init_groups(config: RankConfig) -> RankGroups:
    """Join the engine's ranks (blocks until all `world_size` ranks arrived or the timeout)."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    if config.device_type == "cuda":
        torch.cuda.set_device(config.device)
    timeout = timedelta(seconds=config.timeout_s)
    dist.init_process_group(
        config.backend,
        init_method=f"tcp://{config.master_addr}:{config.master_port}",
        rank=config.rank,
        world_size=config.world_size,
        timeout=timeout,
    )
    ranks = list(range(config.world_size))
    cpu = dist.group.WORLD if config.backend == "gloo" else dist.new_group(ranks, backend="gloo")
    return RankGroups(config=config, ep=dist.group.WORLD, cpu=cpu)


def destroy_groups() -> None:
    """Leave torch.distributed (no-op when it was never initialised)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def rank_groups(config: RankConfig) -> Iterator[RankGroups]:
    """`init_groups` … `destroy_groups`, also when the body raises."""
    groups = init_groups(config)
    try:
        yield groups
    finally:
        destroy_groups()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for spawned test ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
