"""MoE dispatcher registry (`scaleout.md` §2.2): name → factory, chosen by `DispatcherConfig`.

| name             | transport                                   | shapes  | use                   |
|------------------|---------------------------------------------|---------|-----------------------|
| `local`          | none (EP size 1)                            | any     | one rank              |
| `all_to_all`     | `all_to_all_single` with exchanged counts   | dynamic | default (prefill)     |
| `fixed_capacity` | equal-split `all_to_all_single`, C per peer | static  | graph-captured decode |

`fixed_capacity` with `one_pass` keeps the padded layout end to end and reads nothing on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from engine.distributed.dispatch.all_to_all import AllToAllDispatcher
from engine.distributed.dispatch.base import (
    Dispatcher,
    ExpertPlacement,
    RecvBatch,
    SendPlan,
    SlotPlan,
    plan_send,
)
from engine.distributed.dispatch.fixed_capacity import FixedCapacityDispatcher
from engine.distributed.dispatch.local import LocalDispatcher


@dataclass(frozen=True)
class DispatcherConfig:
    """name: a key of `DISPATCHERS`; capacity_tokens: rows per peer and pass, only (and
    required) for `fixed_capacity`; one_pass: `fixed_capacity` only — the caller bounds every
    rank's tokens by capacity_tokens, and the layer reads nothing on the host."""

    name: str = "all_to_all"
    capacity_tokens: int | None = None
    one_pass: bool = False

    def __post_init__(self) -> None:
        if self.name not in DISPATCHERS:
            raise ValueError(
                f"unknown dispatcher {self.name!r}; choose one of {', '.join(DISPATCHERS)}"
            )
        if (self.name == "fixed_capacity") != (self.capacity_tokens is not None):
            raise ValueError("capacity_tokens is required by fixed_capacity and only by it")
        if self.one_pass and self.name != "fixed_capacity":
            raise ValueError("one_pass is an option of fixed_capacity only")


_Factory = Callable[[ExpertPlacement, "dist.ProcessGroup | None", DispatcherConfig], Dispatcher]

DISPATCHERS: dict[str, _Factory] = {
    "local": lambda placement, group, config: LocalDispatcher(placement),
    "all_to_all": lambda placement, group, config: AllToAllDispatcher(placement, group),
    "fixed_capacity": lambda placement, group, config: FixedCapacityDispatcher(
        placement, group, config.capacity_tokens or 0, config.one_pass
    ),
}


def build_dispatcher(
    config: DispatcherConfig, placement: ExpertPlacement, group: dist.ProcessGroup | None
) -> Dispatcher:
    return DISPATCHERS[config.name](placement, group, config)


__all__ = [
    "DISPATCHERS",
    "Dispatcher",
    "DispatcherConfig",
    "ExpertPlacement",
    "RecvBatch",
    "SendPlan",
    "SlotPlan",
    "build_dispatcher",
    "plan_send",
]
