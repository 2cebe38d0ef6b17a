"""Where the Engram tables live, and mapping them from a checkpoint into host memory.

The released tables are 188.8 GiB (FP8 rows + scales, `model.md` §1.4): one copy per GPU rank
cannot fit (`scaleout.md` §1.1). Placements:

    device  each rank reads the tables into its device (or, on the CPU, its own process memory)
    host    each rank maps the tables' byte ranges of the checkpoint's safetensors shards
            read-only (`map_engram_tables`): the OS page cache holds ONE copy per node, shared
            by every rank of the node, and nothing is read at load time
    auto    (the default) `host` on the CPU and whenever there are several ranks; `device` for
            one CUDA rank (its tables fit next to the rest for the presets and the medium
            model, and device gathers avoid the PCIe hop)

NOTE: a model built in memory (random weights, no file) keeps its tables as process tensors;
every served model, presets included, is loaded from a checkpoint folder, so ranks always map.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from pathlib import Path

import torch

from engine.models.deepseek_v41.checkpoint_writer import INDEX_FILE
from engine.models.deepseek_v41.config import DeepseekV41Config

ENGRAM_PLACEMENTS = ("auto", "device", "host")
_HEADER_LEN = struct.Struct("<Q")


def resolve_engram_placement(placement: str, device: str | torch.device, ep_size: int) -> str:
    """`device` or `host` for `placement` (one of `ENGRAM_PLACEMENTS`; see the module
    docstring for `auto`). Raises ValueError for an unknown placement."""
    if placement not in ENGRAM_PLACEMENTS:
        raise ValueError(
            f"engram placement must be one of {', '.join(ENGRAM_PLACEMENTS)}, not {placement!r}"
        )
    if placement != "auto":
        return placement
    return "host" if torch.device(device).type == "cpu" or ep_size > 1 else "device"


def engram_table_names(cfg: DeepseekV41Config) -> dict[int, tuple[str, str]]:
    """Engram layer id → (weight name, scale name) in the checkpoint."""
    return {
        lid: (f"layers.{lid}.engram.embed.weight", f"layers.{lid}.engram.embed.scale")
        for lid in cfg.engram_layer_ids
    }


class _MappedShard:
    """One safetensors file mapped read-only; `tensor(name)` is a zero-copy uint8 view."""

    def __init__(self, file: Path) -> None:
        with open(file, "rb") as handle:
            (header_len,) = _HEADER_LEN.unpack(handle.read(_HEADER_LEN.size))
            self.header = json.loads(handle.read(header_len))
            self.map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.data_start = _HEADER_LEN.size + header_len

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.header[name]
        begin, end = entry["data_offsets"]
        with warnings.catch_warnings():
            # NOTE: the mapping is read-only by design (a write would fault): nothing writes
            # to a table, and torch warns about every non-writable buffer.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(
                self.map, dtype=torch.uint8, count=end - begin, offset=self.data_start + begin
            )
        row_shape = entry["shape"][1:]
        return flat.view(entry["shape"][0], *row_shape) if row_shape else flat


def map_engram_tables(
    folder: Path, cfg: DeepseekV41Config
) -> dict[int, tuple[torch.Tensor, torch.Tensor, object]]:
    """Engram layer id → (weight uint8 [rows, dim], scale uint8 [rows, dim/32], the mapping
    the views point into) of the checkpoint at `folder`, mapped, not read.

    NOTE: the checkpoint's headers are validated by `load_checkpoint` first (names, shapes,
    dtypes); this only locates the byte ranges.
    """
    index = folder / INDEX_FILE
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    shards: dict[str, _MappedShard] = {}

    def view(name: str) -> tuple[torch.Tensor, _MappedShard]:
        shard = weight_map[name] if weight_map is not None else "model.safetensors"
        if shard not in shards:
            shards[shard] = _MappedShard(folder / shard)
        return shards[shard].tensor(name), shards[shard]

    tables = {}
    for lid, (weight_name, scale_name) in engram_table_names(cfg).items():
        weight, weight_shard = view(weight_name)
        scale, scale_shard = view(scale_name)
        tables[lid] = (weight, scale, (weight_shard, scale_shard))
    return tables
