"""The canonical byte layout of one cached 128-token block (`cache.md` §1.3), the same in every
tier: the bytes a host slot holds for a block are exactly the payload of its directory file, so
a move between tiers is one copy.

Per KV source in source order (2, 8, 14, 20 for the released config), the pool rows of the block
split into their parts, each part one contiguous section of rows × part bytes:

    source s    main data      rows × data bytes      (pair j = tokens 2j, 2j+1 at ratio 2)
                main scales    rows × scale bytes
                index data     rows × data bytes
                index scales   rows × scale bytes
    next source ...

Exact storage (float32 rows) has one part per row, so two sections per source. The released
config gives 113,920 bytes; the `tiny` one 13,568. Hosts and files pad to 4 KiB pages.

`gather` reads pool blocks into one uint8 tensor on the pool's device, `scatter` writes one
back; both are device ops the caller orders (no host synchronisation of their own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.models.deepseek_v41.kv_formats import KVCodec
from engine.models.deepseek_v41.state import ModelState, ints_to_device

# Part of the prefix-cache namespace: blocks of another layout are misses, never misread.
LAYOUT_NAME = "cache.md-1.3/v1"


@dataclass(frozen=True)
class BlockSection:
    """Rows `[:, first_byte:end_byte]` of one pool tensor (`kind` "main" or "index" of `source`)
    at `offset` in the payload."""

    kind: str
    source: int
    num_rows: int
    first_byte: int
    end_byte: int
    offset: int

    @property
    def size(self) -> int:
        return self.num_rows * (self.end_byte - self.first_byte)


@dataclass(frozen=True)
class BlockLayout:
    """Where each part of a block's rows lies in its payload (see the module docstring)."""

    sections: tuple[BlockSection, ...]
    payload_len: int

    @classmethod
    def of(cls, state: ModelState, main: KVCodec, index: KVCodec) -> BlockLayout:
        """The layout of `state`'s pool blocks, stored with the codecs `main` and `index`."""
        sections, offset = [], 0
        for source in state.global_kv:
            for kind, codec, pool in (
                ("main", main, state.global_kv[source]),
                ("index", index, state.index_keys[source]),
            ):
                parts = codec.row_sections or (codec.row_width * pool.element_size(),)
                if sum(parts) != pool.shape[-1] * pool.element_size():
                    raise ValueError(f"{codec.name}: row parts {parts} do not fill a pool row")
                first = 0
                for width in parts:
                    section = BlockSection(
                        kind, source, pool.shape[1], first, first + width, offset
                    )
                    sections.append(section)
                    first += width
                    offset += section.size
        return cls(tuple(sections), offset)

    def gather(self, state: ModelState, blocks: Sequence[int]) -> Tensor:
        """uint8 [len(blocks), payload_len] on the pool's device: the payloads of `blocks`."""
        index = _block_index(state, blocks)
        parts = [
            _bytes(state, s)[index, :, s.first_byte : s.end_byte].reshape(len(blocks), -1)
            for s in self.sections
        ]
        return torch.cat(parts, dim=1)

    def scatter(self, state: ModelState, blocks: Sequence[int], payloads: Tensor) -> None:
        """Write uint8 payloads [len(blocks), payload_len] (on the pool's device) into `blocks`.
        Raises ValueError for a wrong shape or dtype."""
        if payloads.dtype != torch.uint8 or tuple(payloads.shape) != (
            len(blocks),
            self.payload_len,
        ):
            raise ValueError(
                f"payloads must be uint8 [{len(blocks)}, {self.payload_len}], got "
                f"{payloads.dtype} {list(payloads.shape)}"
            )
        index = _block_index(state, blocks)
        for s in self.sections:
            rows = payloads[:, s.offset : s.offset + s.size]
            width = s.end_byte - s.first_byte
            _bytes(state, s)[index, :, s.first_byte : s.end_byte] = rows.view(
                len(blocks), s.num_rows, width
            )

    def to_bytes(self, state: ModelState, block: int) -> bytes:
        """The payload of one block as bytes (a device → host copy that waits)."""
        return self.gather(state, [block]).cpu().numpy().tobytes()

    def from_bytes(self, state: ModelState, block: int, payload: bytes) -> None:
        """Write one payload given as bytes. Raises ValueError for a wrong length."""
        if len(payload) != self.payload_len:
            raise ValueError(f"payload of {len(payload)} bytes, expected {self.payload_len}")
        host = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(1, -1)
        self.scatter(state, [block], host.to(_device(state)))


def _bytes(state: ModelState, section: BlockSection) -> Tensor:
    pools = state.global_kv if section.kind == "main" else state.index_keys
    return pools[section.source].view(torch.uint8)


def _device(state: ModelState) -> torch.device:
    return next(iter(state.global_kv.values())).device


def _block_index(state: ModelState, blocks: Sequence[int]) -> Tensor:
    return ints_to_device(list(blocks), _device(state))
