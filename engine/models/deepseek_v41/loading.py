"""`load_model`: a checkpoint folder or hub id → a ready `DeepseekV41ForCausalLM`.

The Engram token map is derived from the checkpoint's own `tokenizer.json` (`model.md` §3.9) and
cached beside it as `engram_token_map.npy`, keyed by the tokenizer file's sha256.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from engine.distributed.expert_parallel import ExpertParallel
from engine.models.deepseek_v41.checkpoint_loader import (
    CheckpointError,
    load_checkpoint,
    read_config,
    routed_expert_filter,
    stored_kinds,
)
from engine.models.deepseek_v41.config import DeepseekV41Config
from engine.models.deepseek_v41.engram import HostEngramTable
from engine.models.deepseek_v41.engram_hash import build_compressed_token_map
from engine.models.deepseek_v41.engram_store import map_engram_tables
from engine.models.deepseek_v41.model import DeepseekV41ForCausalLM, Numerics

TOKEN_MAP_FILE = "engram_token_map.npy"
TOKEN_MAP_META = "engram_token_map.json"


def engram_token_map(folder: Path, cfg: DeepseekV41Config) -> np.ndarray:
    """The raw-id → compressed-id map of the folder's tokenizer (cached sidecar when valid)."""
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CheckpointError(
            f"{folder} has no tokenizer.json; the Engram token map is built from the model's "
            "own tokenizer"
        )
    digest = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    cached, meta = folder / TOKEN_MAP_FILE, folder / TOKEN_MAP_META
    if cached.is_file() and meta.is_file():
        info = json.loads(meta.read_text())
        if info.get("tokenizer_sha256") == digest and info.get("vocab_size") == cfg.vocab_size:
            return np.load(cached)
    token_map = build_compressed_token_map(Tokenizer.from_file(str(tokenizer_file)), cfg.vocab_size)
    num_ids = int(token_map.max()) + 1
    if num_ids != cfg.engram_compressed_vocab_size:
        raise CheckpointError(
            f"the tokenizer in {folder} yields {num_ids} Engram compressed ids but the config "
            f"says engram_compressed_vocab_size = {cfg.engram_compressed_vocab_size}"
        )
    try:
        np.save(cached, token_map)
        meta.write_text(json.dumps({"tokenizer_sha256": digest, "vocab_size": cfg.vocab_size}))
    except OSError:
        pass  # a read-only checkpoint folder: rebuild next time (about a second)
    return token_map


def _without_engram_tables(include: Callable[[str], bool] | None) -> Callable[[str], bool]:
    def keep(name: str) -> bool:
        return ".engram.embed." not in name and (include is None or include(name))

    return keep


def load_model(
    path_or_hub_id: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    numerics: Numerics | None = None,
    include_dspark: bool = True,
    progress: bool = True,
    quantized_experts: bool = False,
    expert_parallel: ExpertParallel | None = None,
    engram_placement: str = "device",
) -> DeepseekV41ForCausalLM:
    """Load a released-format checkpoint; FP8/MXFP4 weights are dequantised to `dtype`, except
    routed experts with `quantized_experts` (kept MXFP4, a quarter of the bf16 bytes) and dense
    linears with `numerics.dense_fp8` (kept FP8 + tile scales, half the bf16 bytes).

    expert_parallel: load the model of one EP rank — only that rank's routed experts are read
    from the shards (every header is still validated); raises `CheckpointError` when the EP
    size does not divide the checkpoint's `n_routed_experts`.

    engram_placement: `device` reads the Engram tables onto `device`; `host` maps them from
    the shards instead (`engram_store.map_engram_tables`: one page-cache copy per node, nothing
    read now) and gathers rows per step (`HostEngramTable`).

    A progress bar is shown on a terminal (`progress=False` silences it).

    Engram tables stay FP8 (dequantised per gathered row). Raises `CheckpointError` naming every
    missing, unexpected or mis-shaped tensor, an unreadable shard, or a mismatching tokenizer.
    """
    include, desc = None, "loading weights"
    if expert_parallel is not None:
        num_experts = read_config(path_or_hub_id).n_routed_experts
        try:
            placement = expert_parallel.placement(num_experts)
        except ValueError as err:
            raise CheckpointError(f"cannot shard {path_or_hub_id} over EP ranks: {err}") from err
        include = routed_expert_filter(placement.owns)
        desc = f"loading weights (EP rank {expert_parallel.rank}/{expert_parallel.size})"
    if engram_placement not in ("device", "host"):
        raise ValueError(f"engram_placement must be device or host, not {engram_placement!r}")
    if engram_placement == "host":
        include = _without_engram_tables(include)
    loaded = load_checkpoint(
        path_or_hub_id,
        dtype=dtype,
        device="cpu",
        include_dspark=include_dspark,
        progress=progress,
        stored_kinds=stored_kinds(quantized_experts, (numerics or Numerics()).dense_fp8),
        include=include,
        progress_desc=desc,
    )
    cfg = loaded.config
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(
            cfg, dtype, numerics, include_dspark, quantized_experts, expert_parallel
        )
    if engram_placement == "host":
        model.attach_host_engram(
            {
                lid: HostEngramTable(weight, scale, mapping)
                for lid, (weight, scale, mapping) in map_engram_tables(loaded.path, cfg).items()
            }
        )
    missing, unexpected = model.load_state_dict(loaded.tensors, strict=False, assign=True)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint tensors do not match the model: missing {sorted(missing)[:20]}, "
            f"unexpected {sorted(unexpected)[:20]}"
        )
    if cfg.engram_layer_ids:
        model.set_engram_token_map(torch.from_numpy(engram_token_map(loaded.path, cfg)))
    model.checkpoint_path = loaded.path
    model = model.to(device).eval()
    if quantized_experts:
        model.pack_routed_experts()
    model.pack_attention_projections()
    return model
