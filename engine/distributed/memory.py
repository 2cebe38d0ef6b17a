"""What one engine rank holds: its weights by part and dtype, planned before loading (from the
config's tensor inventory) and measured after (from the loaded model).

    plan = planned_weight_bytes(cfg, ep_size, dtype, quantized_experts, placement)  # no read
    host = planned_host_bytes(cfg, placement)                       # once per node
    check_memory(plan.total, free, where, num_ranks_sharing_it, host.total)  # before loading
    held, held_host = held_weight_bytes(model), held_host_bytes(model)        # after loading

Parts: `replicated` (embedding, head, attention, dense trunk, shared experts, DSpark with its
experts: every rank holds all of it), `engram` (the Engram tables, listed apart because they
dominate the released model) and `experts` (this rank's `n_routed_experts / N` routed experts
of every layer). With the `host` Engram placement (`engram_store.py`) the tables are not in a
rank's plan but in the node's host plan: one copy mapped by every rank of the node. Bytes are
counted in the format the loader keeps: FP8 dense weights dequantised to the load dtype (as
stored, FP8 + tile scales, with `--dense-gemm fp8`), MXFP4 experts as stored on CUDA in bf16
(else dequantised), Engram tables FP8 + scales, the float32-kept weights in float32.

`RELEASED_EP_SIZE`: the deployment whose per-rank memory is printed at every start (the
released DeepSeek-V4.1-Flash on one 8-GPU host).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.distributed.dispatch import ExpertPlacement
from engine.models.deepseek_v41.checkpoint_loader import (
    is_routed_expert,
    loaded_sizes,
    read_config,
    stored_kinds,
)
from engine.models.deepseek_v41.config import DeepseekV41Config, config_with
from engine.models.deepseek_v41.engram_store import resolve_engram_placement
from engine.models.deepseek_v41.inventory import full_inventory, text_inventory

if TYPE_CHECKING:
    from engine.async_engine import EngineConfig

logger = logging.getLogger(__name__)

PARTS = ("replicated", "engram", "experts")
RELEASED_EP_SIZE = 8
_ENGRAM_TABLE = re.compile(r"\.engram\.embed\.")
_EXPERT_ID = re.compile(r"\.experts\.(\d+)\.")


class InsufficientMemoryError(ValueError):
    """A rank's weights do not fit the memory of its device."""


def part_of(name: str) -> str:
    """The part (`PARTS`) of a weight, by its checkpoint / state-dict name."""
    if is_routed_expert(name):
        return "experts"
    return "engram" if _ENGRAM_TABLE.search(name) else "replicated"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class WeightBytes:
    """Weight bytes of one rank: part → dtype name → bytes (parts with no bytes are absent)."""

    parts: Mapping[str, Mapping[str, int]]

    @classmethod
    def of(cls, sizes: list[tuple[str, torch.dtype, int]]) -> WeightBytes:
        """From (name, dtype, bytes) triples."""
        parts: dict[str, dict[str, int]] = {}
        for name, dtype, nbytes in sizes:
            by_dtype = parts.setdefault(part_of(name), {})
            by_dtype[_dtype_name(dtype)] = by_dtype.get(_dtype_name(dtype), 0) + nbytes
        return cls({p: dict(sorted(parts[p].items())) for p in PARTS if p in parts})

    def part(self, name: str) -> int:
        return sum(self.parts.get(name, {}).values())

    @property
    def total(self) -> int:
        return sum(self.part(p) for p in self.parts)

    def describe(self) -> str:
        """`1.23 GiB (1,320,702,976 B): replicated 1.00 GiB (bfloat16 0.98 GiB, float32 …), …`"""
        parts = []
        for part, by_dtype in self.parts.items():
            dtypes = ", ".join(f"{d} {_size(b)}" for d, b in by_dtype.items())
            parts.append(f"{part} {_size(self.part(part))} ({dtypes})")
        return f"{_size(self.total)} ({self.total:,} B): " + "; ".join(parts)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def held_weight_bytes(model: torch.nn.Module) -> WeightBytes:
    """The bytes of every loaded weight of `model` (its state dict: the checkpoint's tensors)."""
    return WeightBytes.of(
        [(name, t.dtype, t.numel() * t.element_size()) for name, t in model.state_dict().items()]
    )


def held_host_bytes(model: torch.nn.Module) -> WeightBytes:
    """The bytes of `model`'s host-resident Engram tables (the `host` placement; mapped, so
    shared by every rank of the node)."""
    tables = model.host_engram_tables()
    return WeightBytes.of(
        [
            (f"layers.{lid}.engram.embed.{part}", dtype, tensor.numel())
            for lid, table in tables.items()
            for part, dtype, tensor in (
                ("weight", torch.float8_e4m3fn, table.host_weight),
                ("scale", torch.float8_e8m0fnu, table.host_scale),
            )
        ]
    )


def planned_weight_bytes(
    cfg: DeepseekV41Config,
    ep_size: int,
    dtype: torch.dtype,
    quantized_experts: bool = False,
    engram_placement: str = "device",
    include_dspark: bool = True,
    dense_fp8: bool = False,
) -> WeightBytes:
    """What `load_model` will hold on one of `ep_size` ranks (every rank alike) on its device
    (CPU ranks: in their process), from the inventory of `cfg` alone; the Engram tables only
    with the `device` placement; FP8 dense weights as stored with `dense_fp8`. Raises
    ValueError when `ep_size` does not divide the routed experts."""
    placement = ExpertPlacement(cfg.n_routed_experts, ep_size, 0)
    kept = stored_kinds(quantized_experts, dense_fp8)
    specs = full_inventory(cfg) if include_dspark else text_inventory(cfg)
    sizes = []
    for spec in specs:
        if engram_placement == "host" and part_of(spec.name) == "engram":
            continue
        if is_routed_expert(spec.name):
            expert = int(_EXPERT_ID.search(spec.name).group(1))
            if expert not in placement.local_experts:
                continue
        for dt, nbytes in loaded_sizes(spec, cfg.fp8_block_size, dtype, kept).items():
            sizes.append((spec.name, dt, nbytes))
    return WeightBytes.of(sizes)


def planned_host_bytes(cfg: DeepseekV41Config, engram_placement: str) -> WeightBytes:
    """The host memory one node holds once for all its ranks: the Engram tables (FP8 rows +
    scales as stored) with the `host` placement, nothing with `device`."""
    if engram_placement != "host":
        return WeightBytes({})
    sizes = [
        (spec.name, dt, nbytes)
        for spec in text_inventory(cfg)
        if part_of(spec.name) == "engram"
        for dt, nbytes in loaded_sizes(spec, cfg.fp8_block_size, torch.uint8).items()
    ]
    return WeightBytes.of(sizes)


@dataclass(frozen=True)
class MemoryPlan:
    """The weights of one deployment: `device` per rank, `host` once per node."""

    device: WeightBytes
    host: WeightBytes
    engram_placement: str


def plan_weights(config: EngineConfig, model_path: str | Path, ep_size: int) -> MemoryPlan:
    """The plan of one rank of `config` over the checkpoint at `model_path` at `ep_size`
    ranks (reads its config.json only; `config.engram_placement` resolved for them)."""
    cfg = read_config(model_path)
    placement = resolve_engram_placement(config.engram_placement, config.device, ep_size)
    device = planned_weight_bytes(
        cfg,
        ep_size,
        getattr(torch, config.dtype),
        config.quantized_experts,
        placement,
        dense_fp8=config.numerics.dense_fp8,
    )
    return MemoryPlan(device, planned_host_bytes(cfg, placement), placement)


def check_ep_size(config: EngineConfig, ep_size: int) -> None:
    """ValueError, before anything starts, when `ep_size` ranks cannot split the routed
    experts of `config.model` (a preset is generated first)."""
    from engine.models.embedded import resolve_model_source

    _plan_or_raise(config, resolve_model_source(config.model), ep_size)


def _plan_or_raise(config: EngineConfig, model_path: str | Path, ep_size: int) -> MemoryPlan:
    try:
        return plan_weights(config, model_path, ep_size)
    except ValueError as err:
        raise ValueError(f"--ep {ep_size} cannot serve {model_path}: {err}") from None


def log_weight_plans(config: EngineConfig, model_path: str | Path, ep_size: int) -> MemoryPlan:
    """Log, at start, the weights per rank (device) and per node (host) of this checkpoint at
    `ep_size` ranks and those of the released model at `RELEASED_EP_SIZE` with the same
    options; return the former. Raises ValueError when `ep_size` does not divide the
    checkpoint's routed experts."""
    plan = _plan_or_raise(config, model_path, ep_size)
    released = plan_released(config)
    where = f"{config.dtype} on {torch.device(config.device).type}"
    for name, at, got in (
        ("this checkpoint", ep_size, plan),
        ("the released DeepSeek-V4.1-Flash", RELEASED_EP_SIZE, released),
    ):
        logger.info(
            "weights of %s at EP %d (%s), Engram tables on the %s: per rank %s; per node in "
            "host memory, shared by its ranks: %s",
            name,
            at,
            where,
            got.engram_placement,
            got.device.describe(),
            got.host.describe() if got.host.parts else "none",
        )
    return plan


def plan_released(config: EngineConfig) -> MemoryPlan:
    """The plan of the released DeepSeek-V4.1-Flash at `RELEASED_EP_SIZE` ranks with the
    options of `config`."""
    cfg = config_with()
    placement = resolve_engram_placement(config.engram_placement, config.device, RELEASED_EP_SIZE)
    dtype = getattr(torch, config.dtype)
    device = planned_weight_bytes(
        cfg,
        RELEASED_EP_SIZE,
        dtype,
        config.quantized_experts,
        placement,
        dense_fp8=config.numerics.dense_fp8,
    )
    return MemoryPlan(device, planned_host_bytes(cfg, placement), placement)


def free_memory_bytes(device: torch.device) -> int:
    """Memory free now: the device's on CUDA, MemAvailable of the host else."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def check_memory(
    need: int, available: int, where: str, num_ranks: int = 1, shared: int = 0
) -> None:
    """Raise `InsufficientMemoryError` when `num_ranks` ranks needing `need` bytes of weights
    each, plus `shared` bytes held once for all of them (host Engram tables), do not fit the
    `available` bytes of `where` (a device, or the host)."""
    total = need * num_ranks + shared
    if total > available:
        ranks = f"{num_ranks} ranks × " if num_ranks > 1 else ""
        once = f" + {_size(shared)} shared" if shared else ""
        raise InsufficientMemoryError(
            f"{where} has {_size(available)} free, but the weights need {ranks}{_size(need)}"
            f"{once} = {_size(total)} ({total:,} B) before any KV cache or "
            "activation: use more ranks (--ep), fewer ranks per device or machine, a "
            "smaller dtype, or --engram-placement host"
        )


def check_plan(plan: MemoryPlan, device: torch.device, num_local_ranks: int) -> None:
    """`check_memory` of one rank's plan before it loads: its device part on its device
    (CUDA), or this node's ranks' parts together plus the shared host tables in the host's
    memory (CPU); the host tables of a CUDA rank against the host's memory, once.

    NOTE: the node's ranks check at about the same time, before any has loaded much.
    """
    shared = plan.host.total
    if device.type == "cpu":
        free = free_memory_bytes(device)
        check_memory(plan.device.total, free, "the host", num_local_ranks, shared)
        return
    check_memory(plan.device.total, free_memory_bytes(device), str(device))
    if shared:
        check_memory(0, free_memory_bytes(torch.device("cpu")), "the host", shared=shared)


def describe_held(model: torch.nn.Module) -> str:
    """What a loaded model holds: on its device, and in host memory shared by the node."""
    host = held_host_bytes(model)
    shared = (
        f"; in host memory, shared by the node's ranks: {host.describe()}" if host.parts else ""
    )
    return held_weight_bytes(model).describe() + shared
