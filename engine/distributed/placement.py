"""Which attention-DP rank gets a new request (`scaleout.md` §4.1, §6.2). Pure Python.

DeepSeek's decode rule balances request count and total KV length together. As one formula: a
rank's decode step costs `a + b·n + c·K` (n running sequences, K their total KV tokens), and a
request of context L goes to the rank whose projected cost after taking it,

    T_g' = a + b·(n_g + 1) + c·(K_g + L),

is smallest among the ranks that can hold it (a free sequence slot and L tokens of KV room);
ties go to fewer requests, then the lower rank. A short request is decided by the b-term (a rank
with few sequences, even if their caches are long); a long prompt by the c-term (a rank whose KV
is short). Lockstep ranks step at the speed of the slowest, so minimising the chosen rank's new
cost is the greedy choice for the max.

Load views: ranks push `RankLoad` snapshots (`DPPlacer.update`, e.g. every 20 ms); between
snapshots the placer adds its own placements to the view, so a burst does not land on one rank.

Affinity: a request with an `affinity_key` (e.g. `prompt_cache_key`) returns to the rank that
served the key before — its prefix is cached there — while that rank's projected cost stays
within `affinity_slack` of the best rank's; otherwise it goes to the best rank and the key moves.

When no rank can hold the request it goes to the cheapest rank anyway (its scheduler queues it).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DecodeCost:
    """Step-time model of one rank, `a + b·num_seqs + c·kv_tokens` (milliseconds).

    NOTE: the defaults are uncalibrated placeholders (`scaleout.md` §9 item 7); fit a, b, c on
    logged decode steps of the real kernels.
    """

    a: float = 5.0
    b: float = 0.02
    c: float = 2.0e-6

    def __post_init__(self) -> None:
        if min(self.a, self.b, self.c) < 0:
            raise ValueError(f"cost coefficients must be non-negative: {self}")

    def step_ms(self, num_seqs: float, kv_tokens: float) -> float:
        return self.a + self.b * num_seqs + self.c * kv_tokens


@dataclass(frozen=True)
class RankLoad:
    """A rank's load snapshot: running sequences, their KV tokens, and its limits."""

    num_seqs: int = 0
    kv_tokens: int = 0
    kv_capacity_tokens: int = 1 << 62
    max_seqs: int = 1 << 30

    def can_hold(self, context_len: int) -> bool:
        return (
            self.num_seqs + 1 <= self.max_seqs
            and self.kv_tokens + context_len <= self.kv_capacity_tokens
        )

    def plus(self, context_len: int) -> RankLoad:
        return RankLoad(
            self.num_seqs + 1,
            self.kv_tokens + context_len,
            self.kv_capacity_tokens,
            self.max_seqs,
        )


@dataclass(frozen=True)
class PlacementRequest:
    context_len: int
    affinity_key: str | None = None

    def __post_init__(self) -> None:
        if self.context_len < 0:
            raise ValueError(f"context_len must be non-negative, got {self.context_len}")


Policy = Callable[[Sequence[RankLoad], PlacementRequest, DecodeCost], int]


def projected_cost_policy(
    loads: Sequence[RankLoad], request: PlacementRequest, cost: DecodeCost
) -> int:
    """The rank minimising `T_g'` among those that can hold the request (all when none can)."""
    fits = [g for g, load in enumerate(loads) if load.can_hold(request.context_len)]
    candidates = fits or range(len(loads))
    return min(candidates, key=lambda g: (projected_ms(loads[g], request, cost), loads[g].num_seqs))


def projected_ms(load: RankLoad, request: PlacementRequest, cost: DecodeCost) -> float:
    after = load.plus(request.context_len)
    return cost.step_ms(after.num_seqs, after.kv_tokens)


def _round_robin() -> Policy:
    counter = itertools.count()

    def policy(loads: Sequence[RankLoad], request: PlacementRequest, cost: DecodeCost) -> int:
        return next(counter) % len(loads)

    return policy


# Name → factory of a policy (a factory, so stateful policies get fresh state per placer).
PLACEMENT_POLICIES: dict[str, Callable[[], Policy]] = {
    "projected_cost": lambda: projected_cost_policy,
    "round_robin": _round_robin,
}


@dataclass(frozen=True)
class PlacementConfig:
    """policy: a key of `PLACEMENT_POLICIES`; affinity_slack: how much costlier (relative) than
    the best rank a key's rank may be and still keep the key; max_affinity_keys: remembered keys
    (least recently used forgotten first)."""

    policy: str = "projected_cost"
    cost: DecodeCost = field(default_factory=DecodeCost)
    affinity_slack: float = 0.1
    max_affinity_keys: int = 100_000

    def __post_init__(self) -> None:
        if self.policy not in PLACEMENT_POLICIES:
            raise ValueError(
                f"unknown placement policy {self.policy!r}; choose one of "
                f"{', '.join(PLACEMENT_POLICIES)}"
            )
        if self.affinity_slack < 0 or self.max_affinity_keys < 0:
            raise ValueError("affinity_slack and max_affinity_keys must be non-negative")


class DPPlacer:
    """Places requests on `num_ranks` DP ranks (see the module docstring). Not thread-safe:
    one owner (the front end's dispatch loop) calls it."""

    def __init__(self, num_ranks: int, config: PlacementConfig | None = None) -> None:
        if num_ranks < 1:
            raise ValueError(f"need at least one rank, got {num_ranks}")
        self.config = config or PlacementConfig()
        self._policy = PLACEMENT_POLICIES[self.config.policy]()
        self._loads = [RankLoad() for _ in range(num_ranks)]
        self._affinity: OrderedDict[str, int] = OrderedDict()

    @property
    def loads(self) -> tuple[RankLoad, ...]:
        """The current view: the last snapshots plus placements since (read-only)."""
        return tuple(self._loads)

    def update(self, loads: Sequence[RankLoad]) -> None:
        """Replace the view with fresh snapshots, one per rank (mutates the view)."""
        if len(loads) != len(self._loads):
            raise ValueError(f"expected {len(self._loads)} rank loads, got {len(loads)}")
        self._loads = list(loads)

    def place(self, request: PlacementRequest) -> int:
        """The rank for `request`; the view counts it there until the next `update`."""
        cfg = self.config
        rank = self._policy(self._loads, request, cfg.cost)
        key = request.affinity_key
        if key is not None and key in self._affinity:
            pinned = self._affinity[key]
            load = self._loads[pinned]
            best = projected_ms(self._loads[rank], request, cfg.cost)
            if load.can_hold(request.context_len) and projected_ms(
                load, request, cfg.cost
            ) <= best * (1 + cfg.affinity_slack):
                rank = pinned
        if key is not None and cfg.max_affinity_keys:
            self._affinity[key] = rank
            self._affinity.move_to_end(key)
            while len(self._affinity) > cfg.max_affinity_keys:
                self._affinity.popitem(last=False)
        self._loads[rank] = self._loads[rank].plus(request.context_len)
        return rank
