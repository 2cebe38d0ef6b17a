"""Load a DeepSeek-V4.1 checkpoint folder (or hub id) into dequantised tensors (`model.md` §5.4).

`load_checkpoint` works in two passes:

1. Validate: read `config.json`, the index (or a single `model.safetensors`) and every shard's
   header; compare the stored names, shapes and dtypes with the inventory of that config and raise
   ONE `CheckpointError` listing every problem. No tensor data is read in this pass.
2. Load: open one shard at a time and read it tensor by tensor; each logical weight is
   dequantised as soon as all its stored parts (weight and scale, which may sit in different
   shards) have been read.

Partial reads (`include`): every header is still validated, but only the tensors of the included
logical weights are read — an expert-parallel rank reads only its own routed experts
(`routed_expert_filter`); safetensors reads each tensor alone, so the others cost no I/O.

Text-only skips: `vision.*`, `aligner.*`, `image_*` are never loaded, nor `mtp.*` with
`include_dspark=False`. Engram tables (`fp8_rows`) stay FP8 + scales (they are too large to
dequantise): `tensors` holds them under their stored names.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.models.deepseek_v41.checkpoint_writer import INDEX_FILE
from engine.models.deepseek_v41.config import DeepseekV41Config
from engine.models.deepseek_v41.inventory import TensorSpec, full_inventory, text_inventory
from engine.models.deepseek_v41.weight_formats import fp8_block_dequantize, mxfp4_dequantize

SINGLE_FILE = "model.safetensors"
HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "tokenizer*"]
MAX_LISTED_PROBLEMS = 20

# Stored tensors the text engine never loads (model.md §5.4 item 8).
_SKIPPED_PREFIXES = ("vision.", "aligner.", "image_")
_DSPARK_PREFIX = "mtp."
_ROUTED_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint that cannot be found, read or matched against its config."""


@dataclass
class LoadedCheckpoint:
    """The loaded weights of one checkpoint.

    `tensors`: logical weight name → dequantised tensor (fp32-kept names in float32, the rest in
    the requested dtype); Engram tables as stored (`...engram.embed.weight` F8_E4M3 and
    `...engram.embed.scale` F8_E8M0). `quantized`: weight name → (stored weight, stored scale) of
    FP8/MXFP4 weights, filled only with `keep_quantized=True`.
    """

    config: DeepseekV41Config
    path: Path
    tensors: dict[str, torch.Tensor]
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


# ---- locating the checkpoint ----------------------------------------------------------------


def resolve_model_path(path_or_hub_id: str | os.PathLike[str]) -> Path:
    """An existing folder as is; otherwise download the hub repository `path_or_hub_id`.

    Raises `CheckpointError` when the argument is neither an existing folder nor a reachable hub
    repository (offline, unreachable endpoint, unknown or gated repository).
    """
    folder = Path(path_or_hub_id).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists():
        raise CheckpointError(f"{folder} is a file; pass the checkpoint folder")
    return _download_from_hub(str(path_or_hub_id))


def _download_from_hub(hub_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(hub_id)
    except HFValidationError as err:
        raise CheckpointError(
            f"{hub_id!r} is neither an existing local folder nor a valid Hugging Face Hub id"
        ) from err
    try:
        return Path(snapshot_download(hub_id, allow_patterns=HUB_FILE_PATTERNS))
    except (RepositoryNotFoundError, GatedRepoError) as err:
        raise CheckpointError(
            f"no local folder {hub_id!r} exists and the Hugging Face Hub repository {hub_id!r} "
            f"was not found or is not accessible ({type(err).__name__}); pass a local checkpoint "
            f"folder instead"
        ) from err
    except LocalEntryNotFoundError as err:
        cause = err.__cause__ or err
        raise CheckpointError(
            f"no local folder {hub_id!r} exists and the Hugging Face Hub could not be reached to "
            f"download {hub_id!r} ({type(cause).__name__}: {_first_line(cause)}); it is not in "
            f"the local hub cache either. Pass a local checkpoint folder instead."
        ) from err
    except Exception as err:  # network stack errors vary with the hub client version
        raise CheckpointError(
            f"downloading {hub_id!r} from the Hugging Face Hub failed ({type(err).__name__}: "
            f"{_first_line(err)}); pass a local checkpoint folder instead"
        ) from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no details"


# ---- reading headers ------------------------------------------------------------------------


@dataclass(frozen=True)
class _StoredTensor:
    shard: str
    dtype: str
    shape: tuple[int, ...]


def routed_expert_filter(keep_expert: Callable[[int], bool]) -> Callable[[str], bool]:
    """An `include` predicate for `load_checkpoint`: every weight except the target layers'
    routed experts whose global id fails `keep_expert` (DSpark `mtp.*` experts are kept)."""

    def include(name: str) -> bool:
        match = _ROUTED_EXPERT.match(name)
        return match is None or keep_expert(int(match.group(1)))

    return include


def read_config(path_or_hub_id: str | os.PathLike[str]) -> DeepseekV41Config:
    """The checkpoint's config alone (no tensor is read)."""
    return _read_config(resolve_model_path(path_or_hub_id))


def _read_config(folder: Path) -> DeepseekV41Config:
    file = folder / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        return DeepseekV41Config.from_hf_dict(json.loads(file.read_text()))
    except (ValueError, TypeError, KeyError) as err:
        raise CheckpointError(f"{file} is not a valid DeepSeek-V4.1 config: {err}") from err


def _read_weight_map(folder: Path) -> dict[str, str] | None:
    """The index's name → shard map, or None for a single-file checkpoint."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is not a valid safetensors index: {err}") from err
    if (folder / SINGLE_FILE).is_file():
        return None
    raise CheckpointError(f"{folder} has neither {INDEX_FILE} nor {SINGLE_FILE}")


@contextmanager
def _open_shard(folder: Path, shard: str) -> Iterator[Any]:
    """`safe_open` one shard; a missing, truncated or corrupted file raises a `CheckpointError`."""
    file = folder / shard
    if not file.is_file():
        raise CheckpointError(f"shard file {shard} is missing from {folder}")
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except Exception as err:  # SafetensorError, OSError, ... from the header checks
        raise CheckpointError(
            f"shard {shard} in {folder} is corrupted or truncated: {type(err).__name__}: "
            f"{_first_line(err)}"
        ) from err
    with handle:
        yield handle


def _read_headers(folder: Path, shards: list[str]) -> dict[str, _StoredTensor]:
    """Stored name → (shard, dtype, shape) from every shard header (no tensor data is read)."""
    stored: dict[str, _StoredTensor] = {}
    for shard in shards:
        with _open_shard(folder, shard) as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                view = handle.get_slice(name)
                stored[name] = _StoredTensor(shard, view.get_dtype(), tuple(view.get_shape()))
    return stored


# ---- validation -----------------------------------------------------------------------------


def _is_skipped(name: str, include_dspark: bool) -> bool:
    return name.startswith(_SKIPPED_PREFIXES) or (
        not include_dspark and name.startswith(_DSPARK_PREFIX)
    )


def _find_problems(
    specs: list[TensorSpec],
    fp8_block: int,
    stored: dict[str, _StoredTensor],
    weight_map: dict[str, str] | None,
    include_dspark: bool,
) -> list[str]:
    problems: list[str] = []
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}
    for spec in specs:
        dtypes = spec.stored_dtypes()
        for name, shape in spec.stored_shapes(fp8_block).items():
            expected[name] = (dtypes[name], tuple(shape))
    for name, (dtype, shape) in expected.items():
        found = stored.get(name)
        if found is None:
            problems.append(f"missing tensor {name}")
            continue
        if found.shape != shape:
            problems.append(
                f"wrong shape for {name} in {found.shard}: {list(found.shape)}, expected "
                f"{list(shape)}"
            )
        if found.dtype != dtype:
            problems.append(
                f"wrong dtype for {name} in {found.shard}: {found.dtype}, expected {dtype}"
            )
    for name, found in stored.items():
        if name not in expected and not _is_skipped(name, include_dspark):
            problems.append(f"unexpected tensor {name} in {found.shard}")
    for name, shard in (weight_map or {}).items():
        if name in stored and stored[name].shard != shard:
            problems.append(f"index maps {name} to {shard}, but it is in {stored[name].shard}")
        elif name not in stored:
            problems.append(f"index maps {name} to {shard}, but {shard} does not contain it")
    return problems


def _raise_problems(folder: Path, problems: list[str]) -> None:
    lines = problems[:MAX_LISTED_PROBLEMS]
    if len(problems) > MAX_LISTED_PROBLEMS:
        lines.append(f"... and {len(problems) - MAX_LISTED_PROBLEMS} more")
    raise CheckpointError(
        f"checkpoint {folder} does not match its config.json ({len(problems)} problem"
        f"{'s' if len(problems) != 1 else ''}):\n  " + "\n  ".join(lines)
    )


# ---- loading --------------------------------------------------------------------------------


def keeps_fp32(name: str) -> bool:
    """Weights kept in float32 whatever the load dtype (model.md §5.4 item 6)."""
    leaf = name.rsplit(".", 1)[-1]
    return (
        leaf.startswith("hc_")
        or leaf == "attn_sink"
        or name.endswith((".gate.bias", ".gate.bias_vl"))
    )


def _materialise(
    spec: TensorSpec,
    parts: dict[str, torch.Tensor],
    fp8_block: int,
    dtype: torch.dtype,
    stored_kinds: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """Entries of `LoadedCheckpoint.tensors` made from one spec's stored parts (kept as stored
    for the kinds in `stored_kinds`)."""
    target = torch.float32 if keeps_fp32(spec.name) else dtype
    if spec.kind in ("bf16", "f32"):
        return {spec.name: parts[spec.name].to(target)}
    if spec.kind == "fp8_rows" or spec.kind in stored_kinds:
        return parts
    weight, scale = parts[spec.name], parts[spec.scale_name]
    if spec.kind == "fp8":
        return {spec.name: fp8_block_dequantize(weight, scale, block=fp8_block, dtype=target)}
    if spec.kind == "mxfp4":
        return {spec.name: mxfp4_dequantize(weight, scale, dtype=target)}
    raise CheckpointError(f"{spec.name}: unknown storage kind {spec.kind!r}")


# Safetensors dtype strings of the stored kinds → the torch dtype a tensor is read as.
STORED_TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8,
}


def stored_kinds(quantized_experts: bool, dense_fp8: bool) -> tuple[str, ...]:
    """The storage kinds a model holds as stored, not dequantised: MXFP4 routed experts with
    `quantized_experts`, FP8 dense linears with `dense_fp8` (`Numerics.dense_fp8`)."""
    return (("mxfp4",) if quantized_experts else ()) + (("fp8",) if dense_fp8 else ())


def loaded_sizes(
    spec: TensorSpec, fp8_block: int, dtype: torch.dtype, stored_kinds: tuple[str, ...] = ()
) -> dict[torch.dtype, int]:
    """Bytes by dtype of the `LoadedCheckpoint.tensors` entries `_materialise` makes of `spec`
    (reads nothing: sizing a model before loading it)."""
    if spec.kind == "fp8_rows" or spec.kind in stored_kinds:
        sizes: dict[torch.dtype, int] = {}
        stored_dtypes = spec.stored_dtypes()
        for name, shape in spec.stored_shapes(fp8_block).items():
            stored = STORED_TORCH_DTYPES[stored_dtypes[name]]
            sizes[stored] = sizes.get(stored, 0) + math.prod(shape) * stored.itemsize
        return sizes
    target = torch.float32 if keeps_fp32(spec.name) else dtype
    return {target: math.prod(spec.shape) * target.itemsize}


def is_routed_expert(name: str) -> bool:
    """A target layer's routed-expert weight (split over EP ranks; DSpark's are not)."""
    return _ROUTED_EXPERT.match(name) is not None


def load_checkpoint(
    path_or_hub_id: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    include_dspark: bool = True,
    progress: bool = True,
    keep_quantized: bool = False,
    stored_kinds: tuple[str, ...] = (),
    include: Callable[[str], bool] | None = None,
    progress_desc: str = "loading weights",
) -> LoadedCheckpoint:
    """Validate then load a checkpoint folder or hub id (see the module docstring).

    stored_kinds: storage kinds (e.g. `("mxfp4",)`) whose tensors enter `tensors` as stored
    (weight and `.scale`), not dequantised.
    include: logical weight names to read (all when None); the others are validated from the
    headers only and never read.

    Raises `CheckpointError` for: an unreachable/unknown hub id, a missing `config.json` or index,
    a missing, truncated or corrupted shard (naming the shard), and — all in one error — missing,
    unexpected, wrongly shaped or wrongly typed tensors.
    """
    folder = resolve_model_path(path_or_hub_id)
    config = _read_config(folder)
    block = config.fp8_block_size
    specs = full_inventory(config) if include_dspark else text_inventory(config)
    weight_map = _read_weight_map(folder)
    shards = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
    stored = _read_headers(folder, shards)
    problems = _find_problems(specs, block, stored, weight_map, include_dspark)
    if problems:
        _raise_problems(folder, problems)

    if include is not None:
        specs = [spec for spec in specs if include(spec.name)]
    owner: dict[str, TensorSpec] = {}
    names_by_shard: dict[str, list[str]] = {shard: [] for shard in shards}
    for spec in specs:
        for name in spec.stored_shapes(block):
            owner[name] = spec
            names_by_shard[stored[name].shard].append(name)

    result = LoadedCheckpoint(config=config, path=folder, tensors={})
    pending: dict[str, dict[str, torch.Tensor]] = {}  # spec name → parts read so far
    bar = tqdm(
        total=len(specs), desc=progress_desc, unit="tensor", disable=None if progress else True
    )
    with bar:
        for shard in shards:
            with _open_shard(folder, shard) as handle:
                for name in names_by_shard[shard]:
                    spec = owner[name]
                    parts = pending.setdefault(spec.name, {})
                    parts[name] = _read_tensor(handle, folder, shard, name).to(device)
                    if len(parts) < len(spec.stored_shapes(block)):
                        continue
                    del pending[spec.name]
                    result.tensors.update(_materialise(spec, parts, block, dtype, stored_kinds))
                    if keep_quantized and spec.kind in ("fp8", "mxfp4"):
                        result.quantized[spec.name] = (parts[spec.name], parts[spec.scale_name])
                    bar.update()
    return result


def _read_tensor(handle: Any, folder: Path, shard: str, name: str) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except Exception as err:
        raise CheckpointError(
            f"could not read {name} from shard {shard} in {folder}: {type(err).__name__}: "
            f"{_first_line(err)}"
        ) from err
