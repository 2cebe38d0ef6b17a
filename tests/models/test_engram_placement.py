"""Engram tables in host memory (`engram_store.py`): mapped from the checkpoint, not read or
copied, and the same logits as the tables on the device, bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from engine.models import load_model, sequential_batch
from engine.models.deepseek_v41.checkpoint_writer import INDEX_FILE
from engine.models.deepseek_v41.engram_store import resolve_engram_placement
from engine.models.embedded import ensure_embedded_checkpoint


def _steps(model) -> list[torch.Tensor]:
    """Logits of a two-sequence prefill (one crossing a 128-token block) and three decode
    steps fed the greedy tokens."""
    vocab = model.config.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(140)], [(11 * i + 5) % vocab for i in range(9)]]
    batch, state = model.fresh_batch([p + [0] * 8 for p in prompts])
    step = sequential_batch(prompts, [0, 0], [0, 1], batch.block_tables)
    positions, last = [len(p) for p in prompts], [len(prompts[0]) - 1, sum(map(len, prompts)) - 1]
    logits = []
    with torch.inference_mode():
        for _ in range(4):
            logits.append(model.forward_step(step, state).logits)
            tokens = logits[-1][last].argmax(-1).tolist()
            step = sequential_batch([[t] for t in tokens], positions, [0, 1], batch.block_tables)
            positions, last = [p + 1 for p in positions], [0, 1]
    return logits


# `default`: ~5 s (its checkpoint, the real vocabulary)
@pytest.mark.parametrize("preset", ["tiny", pytest.param("default", marks=pytest.mark.slow)])
def test_host_tables_give_the_device_logits_bitwise(
    preset: str, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    folder = tiny_checkpoint if preset == "tiny" else ensure_embedded_checkpoint("default")
    on_device = load_model(folder, progress=False)
    on_host = load_model(folder, progress=False, engram_placement="host")
    assert not on_device.host_engram_tables()
    assert sorted(on_host.host_engram_tables()) == list(on_host.config.engram_layer_ids)
    want, got = _steps(on_device), _steps(on_host)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_host_tables_are_the_page_cache_of_the_shard_not_a_copy(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    """The table bytes are the file's mapping (the page cache every process of the node
    shares): bytes written to the shard after loading show through the loaded table."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, folder)
    model = load_model(folder, progress=False, engram_placement="host")
    assert "layers.0.engram.embed.weight" not in model.state_dict()
    table = model.host_engram_tables()[0]
    name = "layers.0.engram.embed.weight"
    file = folder / json.loads((folder / INDEX_FILE).read_text())["weight_map"][name]
    with open(file, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
    begin = 8 + header_len + header[name]["data_offsets"][0]
    row = bytes(range(1, 1 + table.host_weight.shape[1]))
    assert bytes(table.host_weight[0].tolist()) != row
    fd = os.open(file, os.O_WRONLY)
    try:
        os.pwrite(fd, row, begin)
    finally:
        os.close(fd)
    assert bytes(table.host_weight[0].tolist()) == row


def test_auto_placement_is_host_on_the_cpu_and_for_several_ranks() -> None:
    assert resolve_engram_placement("auto", "cpu", 1) == "host"
    assert resolve_engram_placement("auto", "cuda:0", 8) == "host"
    assert resolve_engram_placement("auto", "cuda:0", 1) == "device"
    assert resolve_engram_placement("device", "cpu", 2) == "device"
    with pytest.raises(ValueError, match="engram placement must be one of auto, device, host"):
        resolve_engram_placement("disk", "cpu", 1)
