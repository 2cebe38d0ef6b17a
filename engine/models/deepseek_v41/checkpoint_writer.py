"""Random DeepSeek-V4.1 checkpoints in exactly the released file format (`model.md` §5, §11).

`write_random_checkpoint` writes, for any configuration, the folder a loader expects from the real
release: `config.json` (nested), `model.safetensors.index.json`, shards
`model-000NN-of-000MM.safetensors` with the inventory's names, stored dtypes and stored shapes,
`generation_config.json` and, for the known vocabularies, the tokenizer files.

Determinism: every tensor is drawn from its own generator seeded by sha256(seed, tensor name[,
chunk]), so its bytes depend on neither the writing order nor on which other tensors exist; the
same seed gives byte-identical files.

Memory: shards are planned from the inventory alone (stored sizes are known up front), then each
shard is streamed to disk one tensor at a time behind a pre-computed safetensors header. A few
threads draw and quantise the next tensors while the main thread writes; peak memory is a few
tensors (with their fp32 draws), never a shard or the whole state. Engram tables are drawn and
quantised in row chunks, so even the real 98 G-element tables stream.

Speed: values are always drawn on the CPU; quantisation runs on a GPU when one is present (same
bytes, see `_Drawing`), which is what makes `medium` (~95 GB) practical to write.

The shard file layout (standard safetensors)::

    [u64 little-endian header length N][N bytes JSON header, space padded to 8][data ...]
    data: tensors back to back, F32 first, then BF16, then 1-byte dtypes
          (each group keeps inventory order, so every tensor's offset is aligned to its item size)
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import re
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.models.deepseek_v41.config import DeepseekV41Config, resolve_config
from engine.models.deepseek_v41.inventory import TensorSpec, full_inventory, text_inventory
from engine.models.deepseek_v41.tokenizer_files import write_tiny_tokenizer, write_v41_tokenizer
from engine.models.deepseek_v41.weight_formats import (
    fp8_block_quantize,
    fp8_row_quantize,
    mxfp4_quantize,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# Safetensors dtype string → (torch dtype, bytes per element).
STORED_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F32": (torch.float32, 4),
    "BF16": (torch.bfloat16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),
    "I8": (torch.int8, 1),
}

# Rows of an Engram table drawn and quantised at once (64 MB of fp32 at the real width 256).
_ENGRAM_CHUNK_ROWS = 1 << 16

# Threads drawing and quantising tensors while the main thread writes.
_NUM_WORKERS = min(16, os.cpu_count() or 1)

# Tokenizer written beside the weights, by vocabulary size (model.md §8, §11.1).
_TOKENIZER_WRITERS: dict[int, Callable[[DeepseekV41Config, Path], None]] = {
    129280: lambda cfg, folder: write_v41_tokenizer(folder),
    1024: lambda cfg, folder: write_tiny_tokenizer(
        folder, cfg.vocab_size, cfg.engram_compressed_vocab_size
    ),
}


def shard_file_name(index: int, num_shards: int) -> str:
    """`model-000NN-of-000MM.safetensors` for the 0-based shard `index`."""
    return f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"


def stored_nbytes(spec: TensorSpec, fp8_block: int) -> int:
    """Bytes `spec` occupies in the shard files (weight plus scale, without headers)."""
    dtypes = spec.stored_dtypes()
    return sum(
        math.prod(shape) * STORED_DTYPES[dtypes[name]][1]
        for name, shape in spec.stored_shapes(fp8_block).items()
    )


def plan_shards(
    specs: list[TensorSpec], fp8_block: int, max_shard_bytes: int
) -> list[list[TensorSpec]]:
    """Split `specs` (in order) into shards of at most `max_shard_bytes` stored bytes.

    A weight and its scale always share a shard. A spec larger than the budget gets a shard of
    its own (the budget is a target, not a hard cap).
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        size = stored_nbytes(spec, fp8_block)
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += size
    return shards


def write_random_checkpoint(
    config_name_or_dict: str | dict[str, Any] | DeepseekV41Config,
    path: str | os.PathLike[str],
    seed: int = 0,
    include_dspark: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a random checkpoint of the given config (preset name, nested/flat dict or config).

    Returns the checkpoint folder (created if needed). Files of the same name are overwritten;
    `config.json` is written last, so a folder interrupted mid-way is not loadable.
    The Engram token-map sidecar is not written here.
    """
    cfg = resolve_config(config_name_or_dict)
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    specs = full_inventory(cfg) if include_dspark else text_inventory(cfg)
    block = cfg.fp8_block_size
    shards = plan_shards(specs, block, max_shard_bytes)
    drawing = _Drawing(seed, block, _quantize_device())

    total_size = sum(stored_nbytes(spec, block) for spec in specs)
    logger.info(
        "writing a random checkpoint (%.2f GB in %d shards) to %s",
        total_size / 1e9,
        len(shards),
        folder,
    )
    weight_map: dict[str, str] = {}
    started = time.monotonic()
    for i, shard_specs in enumerate(shards):
        file_name = shard_file_name(i, len(shards))
        _write_shard(folder / file_name, shard_specs, drawing)
        elapsed = time.monotonic() - started
        logger.info("checkpoint shard %d/%d written (%.0f s)", i + 1, len(shards), elapsed)
        for spec in shard_specs:
            weight_map.update(dict.fromkeys(spec.stored_shapes(block), file_name))
    _remove_stale_shards(folder, keep=set(weight_map.values()))
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(folder / INDEX_FILE, index)

    tokenizer_writer = _TOKENIZER_WRITERS.get(cfg.vocab_size)
    if tokenizer_writer is not None:
        tokenizer_writer(cfg, folder)
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    _write_json(folder / "generation_config.json", generation)
    _write_json(folder / "config.json", cfg.to_hf_dict())
    return folder


def _remove_stale_shards(folder: Path, keep: set[str]) -> None:
    """Delete shard files of an earlier write into `folder` (only our own shard-name pattern)."""
    for file in folder.glob("model-*-of-*.safetensors"):
        if _SHARD_NAME.fullmatch(file.name) and file.name not in keep:
            file.unlink()


# ---- one shard ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Slot:
    """Where one stored tensor lives in a shard's data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _shard_layout(specs: list[TensorSpec], fp8_block: int) -> dict[str, _Slot]:
    """Stored name → slot, ordered by descending item size (keeps every offset aligned)."""
    entries = []
    for spec in specs:
        dtypes = spec.stored_dtypes()
        for name, shape in spec.stored_shapes(fp8_block).items():
            entries.append((name, dtypes[name], tuple(shape)))
    entries.sort(key=lambda e: -STORED_DTYPES[e[1]][1])  # stable: inventory order within a size
    layout: dict[str, _Slot] = {}
    offset = 0
    for name, dtype, shape in entries:
        size = math.prod(shape) * STORED_DTYPES[dtype][1]
        layout[name] = _Slot(dtype, shape, offset, offset + size)
        offset += size
    return layout


def _safetensors_header(layout: dict[str, _Slot]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for name, slot in layout.items():
        header[name] = {
            "dtype": slot.dtype,
            "shape": list(slot.shape),
            "data_offsets": [slot.begin, slot.end],
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_shard(file: Path, specs: list[TensorSpec], drawing: _Drawing) -> None:
    """Stream the random tensors of `specs` into one safetensors file (atomic rename at the end)."""
    layout = _shard_layout(specs, drawing.fp8_block)
    header = _safetensors_header(layout)
    data_size = max((slot.end for slot in layout.values()), default=0)
    written = dict.fromkeys(layout, 0)
    partial = file.with_name(file.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(header)
            f.truncate(len(header) + data_size)
            jobs = [job for spec in specs for job in _generation_jobs(spec, drawing)]
            for pieces in _run_in_order(jobs):
                for name, byte_offset, tensor in pieces:
                    data = _piece_bytes(name, layout[name], byte_offset, tensor)
                    f.seek(len(header) + layout[name].begin + byte_offset)
                    f.write(memoryview(data))
                    written[name] += data.nbytes
        unfilled = [name for name, slot in layout.items() if written[name] != slot.end - slot.begin]
        if unfilled:
            raise RuntimeError(f"the generator did not fill {unfilled} in {file.name}")
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, file)


def _piece_bytes(name: str, slot: _Slot, byte_offset: int, tensor: torch.Tensor) -> Any:
    """The raw bytes of one generated piece, after checking it fits its slot."""
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    expected = STORED_DTYPES[slot.dtype][0]
    fits = byte_offset + data.nbytes <= slot.end - slot.begin
    if tensor.dtype != expected or tuple(tensor.shape[1:]) != slot.shape[1:] or not fits:
        raise RuntimeError(
            f"generated {name} as {tensor.dtype} {list(tensor.shape)} at byte {byte_offset}, "
            f"but the inventory stores {slot.dtype} {list(slot.shape)}"
        )
    return data


# ---- random values --------------------------------------------------------------------------


def _quantize_device() -> torch.device:
    """A GPU when present (same bytes, much faster for `medium`), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _generator(seed: int, name: str, chunk: int | None = None) -> torch.Generator:
    """A generator that depends only on (seed, name, chunk) — stable across runs and platforms."""
    key = f"{seed}\x00{name}" + ("" if chunk is None else f"\x00{chunk}")
    digest = hashlib.sha256(key.encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


# Standard deviations of `init="small"` tensors, by the last component of their name. Chosen so a
# random 8-layer model keeps O(1) activations while every mixing path stays non-degenerate:
# sinks act like one more attention logit; mHC fn rows give mixing logits m ~ N(0, 1) which the
# small scale/base turn into pre ≈ 0.5, post ≈ 1 and a near-uniform (but not exactly uniform)
# Sinkhorn matrix; gate biases perturb, never dominate, the expert choice.
_SMALL_STD_BY_LEAF: dict[str, float | None] = {
    "attn_sink": 1.0,
    "hc_attn_fn": None,  # None: 1/sqrt(fan_in)
    "hc_ffn_fn": None,
    "hc_attn_base": 0.1,
    "hc_ffn_base": 0.1,
    "hc_attn_scale": 0.1,
    "hc_ffn_scale": 0.1,
    "bias": 0.1,
    "bias_vl": 0.1,
}
_SMALL_STD = 0.02  # embeddings and anything else marked "small"
_ONES_NOISE_STD = 0.02


def init_mean_std(spec: TensorSpec) -> tuple[float, float]:
    """(mean, std) of the normal distribution a random weight is drawn from."""
    fan_in_std = spec.shape[-1] ** -0.5
    if spec.init == "normal":
        return 0.0, fan_in_std
    if spec.init == "ones":
        return 1.0, _ONES_NOISE_STD
    if spec.init == "zeros":
        return 0.0, 0.0
    if spec.init == "small":
        std = _SMALL_STD_BY_LEAF.get(spec.name.rsplit(".", 1)[-1], _SMALL_STD)
        return 0.0, fan_in_std if std is None else std
    raise ValueError(f"{spec.name}: unknown init {spec.init!r}")


def _draw(spec: TensorSpec, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    mean, std = init_mean_std(spec)
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    return values.mul_(std).add_(mean)


_Piece = tuple[str, int, torch.Tensor]  # (stored name, byte offset inside it, data)


@dataclass(frozen=True)
class _Drawing:
    """How values are made: the seed, the FP8 tile side and where quantisers run.

    NOTE: values are always drawn on the CPU (CUDA generators give other numbers); quantising on
    a GPU gives the same bytes because every quantiser step is exact (power-of-two scales from
    frexp and IEEE bits, comparisons, correctly rounded casts).
    """

    seed: int
    fp8_block: int
    quantize_on: torch.device


def _generation_jobs(spec: TensorSpec, drawing: _Drawing) -> list[Callable[[], list[_Piece]]]:
    """Independent jobs that together produce every stored byte of `spec`.

    One job per tensor; an Engram table gets one job per row chunk, each drawn from its own
    (seed, name, chunk) generator, so no job ever holds the whole table.
    """
    if spec.kind == "fp8_rows":
        rows = spec.shape[0]
        return [
            functools.partial(_engram_chunk, spec, drawing, chunk, start)
            for chunk, start in enumerate(range(0, rows, _ENGRAM_CHUNK_ROWS))
        ]
    return [functools.partial(_quantized_pieces, spec, drawing)]


def _quantized_pieces(spec: TensorSpec, drawing: _Drawing) -> list[_Piece]:
    values = _draw(spec, spec.shape, _generator(drawing.seed, spec.name))
    if spec.kind == "bf16":
        return [(spec.name, 0, values.to(torch.bfloat16))]
    if spec.kind == "f32":
        return [(spec.name, 0, values)]
    values = values.to(drawing.quantize_on)
    if spec.kind == "fp8":
        weight, scale = fp8_block_quantize(values, block=drawing.fp8_block)
    elif spec.kind == "mxfp4":
        weight, scale = mxfp4_quantize(values)
    else:
        raise ValueError(f"{spec.name}: unknown storage kind {spec.kind!r}")
    return [(spec.name, 0, weight.cpu()), (spec.scale_name, 0, scale.cpu())]


def _engram_chunk(spec: TensorSpec, drawing: _Drawing, chunk: int, start: int) -> list[_Piece]:
    rows, width = spec.shape
    num_rows = min(_ENGRAM_CHUNK_ROWS, rows - start)
    values = _draw(spec, (num_rows, width), _generator(drawing.seed, spec.name, chunk))
    weight, scale = fp8_row_quantize(values.to(drawing.quantize_on))
    return [
        (spec.name, start * width, weight.cpu()),
        (spec.scale_name, start * (width // 32), scale.cpu()),
    ]


def _run_in_order(jobs: list[Callable[[], list[_Piece]]]) -> Iterator[list[_Piece]]:
    """Results of `jobs` in order, computed by a few threads (torch ops release the GIL).

    NOTE: at most 2 × workers results exist at once, which bounds memory to a few tensors.
    Every job owns its generator, so the bytes do not depend on the thread schedule.
    """
    if _NUM_WORKERS <= 1:
        yield from (job() for job in jobs)
        return
    with ThreadPoolExecutor(_NUM_WORKERS) as pool:
        in_flight: deque[Future[list[_Piece]]] = deque()
        for job in jobs:
            in_flight.append(pool.submit(job))
            if len(in_flight) >= 2 * _NUM_WORKERS:
                yield in_flight.popleft().result()
        while in_flight:
            yield in_flight.popleft().result()


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2) + "\n")
