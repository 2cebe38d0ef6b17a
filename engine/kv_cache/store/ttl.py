"""Traffic classes and their time-to-live in the directory tiers (`cache.md` §2.4).

A block's file mtime holds its expiry deadline, `last access + TTL(class of that access)`,
only ever extended. `TTLPolicy` maps class names to TTLs and parses the `--kv-ttl` syntax
`agent=3d,chat=7d` (units s, m, h, d).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

AGENT = "agent"
CHAT = "chat"
DEFAULT_TTL_SPEC = "agent=3d,chat=7d"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_CLASS_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
_ITEM = re.compile(r"^([^=]+)=(\d+(?:\.\d+)?)([smhd])$")


def is_valid_class_name(name: str) -> bool:
    """Lower-case letters, digits, `_` and `-`, 1..32 characters, starting alphanumeric."""
    return bool(_CLASS_NAME.match(name))


@dataclass(frozen=True)
class TTLPolicy:
    """ttl_s: seconds a block lives after an access of each traffic class. Must define
    `agent` and `chat` (the defaults chosen from whether a request declares tools).

    touch_min_extend_s: a hit rewrites a file's deadline only if that extends it by at least
    max(this, 1 % of the class's TTL), so hot blocks cost a metadata write a few times an hour.
    """

    ttl_s: Mapping[str, float] = field(
        default_factory=lambda: MappingProxyType({AGENT: 3 * 86400.0, CHAT: 7 * 86400.0})
    )
    touch_min_extend_s: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "ttl_s", MappingProxyType(dict(self.ttl_s)))
        for name, ttl in self.ttl_s.items():
            if not is_valid_class_name(name):
                raise ValueError(f"traffic class {name!r}: use [a-z0-9_-], at most 32 characters")
            if not ttl > 0:
                raise ValueError(f"traffic class {name!r}: the TTL must be > 0")
        missing = {AGENT, CHAT} - self.ttl_s.keys()
        if missing:
            raise ValueError(f"--kv-ttl must define the classes {sorted(missing)}")
        if self.touch_min_extend_s < 0:
            raise ValueError("touch_min_extend_s must be >= 0")

    @classmethod
    def parse(cls, spec: str) -> TTLPolicy:
        """`agent=3d,chat=7d,batch=12h` → a policy. Raises ValueError naming the bad item."""
        ttls: dict[str, float] = {}
        for item in spec.split(","):
            match = _ITEM.match(item.strip())
            if match is None:
                raise ValueError(f"--kv-ttl item {item!r}: expected CLASS=NUMBER[s|m|h|d]")
            name, number, unit = match.groups()
            if name in ttls:
                raise ValueError(f"--kv-ttl names the class {name!r} twice")
            ttls[name] = float(number) * _UNITS[unit]
        return cls(ttl_s=ttls)

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(sorted(self.ttl_s))

    def ttl(self, traffic_class: str) -> float:
        """The class's TTL. Raises KeyError for a class the policy does not define."""
        return self.ttl_s[traffic_class]

    def min_extend(self, traffic_class: str) -> float:
        return max(self.touch_min_extend_s, 0.01 * self.ttl(traffic_class))

    def eviction_rank(self, deadline: float, depth: int) -> tuple[float, int, float]:
        """GC order (smallest first): earliest deadline, deeper first among deadlines within
        one touch granule (`touch_min_extend_s`).

        A chain is written (and touched) parent first, microseconds apart, and touches move a
        deadline only in steps of the granule: ordering by exact deadlines would evict a root
        before its leaves and strand them. Within a granule they are ties (`cache.md` §2.4:
        "ties → deeper first")."""
        return (deadline // (self.touch_min_extend_s or 1.0), -depth, deadline)

    def describe(self) -> str:
        return ",".join(f"{name}={_human(ttl)}" for name, ttl in sorted(self.ttl_s.items()))


def default_class(has_tools: bool) -> str:
    """The class of a request that names none: agent when it declares tools, else chat."""
    return AGENT if has_tools else CHAT


def _human(seconds: float) -> str:
    for unit in ("d", "h", "m"):
        if seconds % _UNITS[unit] == 0:
            return f"{int(seconds // _UNITS[unit])}{unit}"
    return f"{seconds:g}s"
