"""`ExpertParallel`: what a model needs to hold and run only this rank's routed experts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from engine.distributed.dispatch import (
    Dispatcher,
    DispatcherConfig,
    ExpertPlacement,
    build_dispatcher,
)
from engine.distributed.groups import RankGroups


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's place in the EP group and the dispatcher its MoE layers use.

    group: the EP process group (None: the default group, or no group for size 1).
    """

    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    dispatcher: DispatcherConfig = field(default_factory=DispatcherConfig)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"EP rank {self.rank} is outside an EP group of size {self.size}")
        if self.size > 1 and self.dispatcher.name == "local":
            raise ValueError("the local dispatcher serves EP size 1 only")

    @classmethod
    def from_groups(
        cls, groups: RankGroups, dispatcher: DispatcherConfig | None = None
    ) -> ExpertParallel:
        return cls(groups.rank, groups.world_size, groups.ep, dispatcher or DispatcherConfig())

    def placement(self, num_experts: int) -> ExpertPlacement:
        """This rank's experts of a table of `num_experts` (ValueError when not divisible)."""
        return ExpertPlacement(num_experts, self.size, self.rank)

    def build_dispatcher(self, num_experts: int) -> Dispatcher:
        return build_dispatcher(self.dispatcher, self.placement(num_experts), self.group)
