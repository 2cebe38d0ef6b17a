"""What one engine rank holds: its weights by part and dtype, planned before loading (from the
config's tensor inventory) and measured after (from the loaded model).

    plan = planned_weight_bytes(cfg, ep_size, dtype, quantized_experts)   # no tensor read
    check_memory(plan.total, device, num_ranks_sharing_it)                # before loading
    held = held_weight_bytes(model)                                       # after loading

Parts: `replicated` (embedding, head, attention, dense trunk, shared experts, DSpark with its
experts: every rank holds all of it), `engram` (the Engram tables, replicated too, listed apart
because they dominate the released model) and `experts` (this rank's `n_routed_experts / N`
routed experts of every layer). Bytes are counted in the format the loader keeps: FP8 weights
dequantised to the load dtype, MXFP4 experts as stored on CUDA in bf16 (else dequantised),
Engram tables FP8 + scales, the float32-kept weights in float32.

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
)
from engine.models.deepseek_v41.config import DeepseekV41Config, config_with
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


def planned_weight_bytes(
    cfg: DeepseekV41Config,
    ep_size: int,
    dtype: torch.dtype,
    quantized_experts: bool = False,
    include_dspark: bool = True,
) -> WeightBytes:
    """What `load_model` will hold on one of `ep_size` ranks (every rank alike), from the
    inventory of `cfg` alone. Raises ValueError when `ep_size` does not divide the routed
    experts."""
    placement = ExpertPlacement(cfg.n_routed_experts, ep_size, 0)
    stored_kinds = ("mxfp4",) if quantized_experts else ()
    specs = full_inventory(cfg) if include_dspark else text_inventory(cfg)
    sizes = []
    for spec in specs:
        if is_routed_expert(spec.name):
            expert = int(_EXPERT_ID.search(spec.name).group(1))
            if expert not in placement.local_experts:
                continue
        for dt, nbytes in loaded_sizes(spec, cfg.fp8_block_size, dtype, stored_kinds).items():
            sizes.append((spec.name, dt, nbytes))
    return WeightBytes.of(sizes)


def plan_weights(config: EngineConfig, model_path: str | Path, ep_size: int) -> WeightBytes:
    """`planned_weight_bytes` of one rank of `config` over the checkpoint at `model_path`
    (reads its config.json only)."""
    return planned_weight_bytes(
        read_config(model_path), ep_size, getattr(torch, config.dtype), config.quantized_experts
    )


def check_ep_size(config: EngineConfig, ep_size: int) -> None:
    """ValueError, before anything starts, when `ep_size` ranks cannot split the routed
    experts of `config.model` (a preset is generated first)."""
    from engine.models.embedded import resolve_model_source

    _plan_or_raise(config, resolve_model_source(config.model), ep_size)


def _plan_or_raise(config: EngineConfig, model_path: str | Path, ep_size: int) -> WeightBytes:
    try:
        return plan_weights(config, model_path, ep_size)
    except ValueError as err:
        raise ValueError(f"--ep {ep_size} cannot serve {model_path}: {err}") from None


def log_weight_plans(config: EngineConfig, model_path: str | Path, ep_size: int) -> WeightBytes:
    """Log, at start, the weights per rank of this checkpoint at `ep_size` ranks and those of
    the released model at `RELEASED_EP_SIZE` in the same format; return the former.
    Raises ValueError when `ep_size` does not divide the checkpoint's routed experts."""
    plan = _plan_or_raise(config, model_path, ep_size)
    dtype = getattr(torch, config.dtype)
    released = planned_weight_bytes(
        config_with(), RELEASED_EP_SIZE, dtype, config.quantized_experts
    )
    where = f"{config.dtype} on {torch.device(config.device).type}"
    logger.info("weights per rank at EP %d (%s): %s", ep_size, where, plan.describe())
    logger.info(
        "weights per rank of the released DeepSeek-V4.1-Flash at EP %d (%s): %s",
        RELEASED_EP_SIZE,
        where,
        released.describe(),
    )
    return plan


def free_memory_bytes(device: torch.device) -> int:
    """Memory free now: the device's on CUDA, MemAvailable of the host else."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def check_memory(need: int, available: int, where: str, num_ranks: int = 1) -> None:
    """Raise `InsufficientMemoryError` when `num_ranks` ranks needing `need` bytes of weights
    each do not fit the `available` bytes of `where` (a device, or the host for CPU ranks)."""
    if need * num_ranks > available:
        ranks = f"{num_ranks} ranks × " if num_ranks > 1 else ""
        raise InsufficientMemoryError(
            f"{where} has {_size(available)} free, but the weights need {ranks}{_size(need)}"
            f" = {_size(need * num_ranks)} ({need * num_ranks:,} B) before any KV cache or "
            "activation: use more ranks (--ep), fewer ranks per device or machine, or a "
            "smaller dtype"
        )
