"""Random checkpoints in the released format: writing, determinism, loading and validation."""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.models import CheckpointError, load_checkpoint, write_random_checkpoint
from engine.models.deepseek_v41.checkpoint_loader import keeps_fp32, resolve_model_path
from engine.models.deepseek_v41.checkpoint_writer import stored_nbytes
from engine.models.deepseek_v41.config import DeepseekV41Config, preset_config
from engine.models.deepseek_v41.inventory import full_inventory, text_inventory
from engine.models.deepseek_v41.weight_formats import (
    fp8_block_dequantize,
    fp8_block_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
)

SHARD_BUDGET = 400_000  # forces several shards for `tiny` (≈ 2.25 MB stored)
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(
        "tiny", tmp_path_factory.mktemp("tiny"), seed=0, max_shard_bytes=SHARD_BUDGET
    )


@pytest.fixture
def tiny_copy(tiny_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "ckpt"))


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())


def _stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(_index(folder)["weight_map"].values())):
        out.update(load_file(folder / shard))
    return out


def _shard_of(folder: Path, name: str) -> Path:
    return folder / _index(folder)["weight_map"][name]


def _rewrite_shard(folder: Path, name_in_shard: str, edit) -> Path:
    """Load the shard holding `name_in_shard`, apply `edit(dict)` and save it back."""
    shard = _shard_of(folder, name_in_shard)
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def _load_error(folder: Path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder, progress=False, **kwargs)
    return str(info.value)


# ---- format -----------------------------------------------------------------------------------


def test_files_config_and_index_follow_the_released_layout(tiny_dir: Path) -> None:
    cfg = preset_config("tiny")
    for name in ("config.json", INDEX, "generation_config.json", "tokenizer.json"):
        assert (tiny_dir / name).is_file(), name

    raw_config = json.loads((tiny_dir / "config.json").read_text())
    assert raw_config["text_config"]["hidden_size"] == 64  # nested, as released
    assert raw_config["quantization_config"]["weight_block_size"] == [32, 32]
    assert DeepseekV41Config.from_hf_dict(raw_config) == cfg
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)

    expected: dict[str, tuple[str, tuple[int, ...]]] = {}
    for spec in full_inventory(cfg):
        dtypes = spec.stored_dtypes()
        for name, shape in spec.stored_shapes(cfg.fp8_block_size).items():
            expected[name] = (dtypes[name], tuple(shape))

    index = _index(tiny_dir)
    weight_map = index["weight_map"]
    assert set(weight_map) == set(expected)
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 2
    num = len(shards)
    assert shards == [f"model-{i:05d}-of-{num:05d}.safetensors" for i in range(1, num + 1)]

    data_bytes = 0
    for shard in shards:
        file = tiny_dir / shard
        (header_len,) = struct.unpack("<Q", file.read_bytes()[:8])
        header = json.loads(file.read_bytes()[8 : 8 + header_len])
        shard_data = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        assert file.stat().st_size == 8 + header_len + shard_data
        data_bytes += shard_data
        with safe_open(file, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                assert weight_map[name] == shard
                view = handle.get_slice(name)
                assert (view.get_dtype(), tuple(view.get_shape())) == expected[name], name
        # weight and scale share a shard; a shard exceeds the budget only with a single weight
        names = [k for k in header if k != "__metadata__"]
        logical = {n.removesuffix(".scale").removesuffix(".weight") for n in names}
        assert shard_data <= SHARD_BUDGET or len(logical) == 1
    total = sum(stored_nbytes(spec, cfg.fp8_block_size) for spec in full_inventory(cfg))
    assert index["metadata"]["total_size"] == data_bytes == total


def test_same_seed_gives_identical_bytes_and_tensors_do_not_depend_on_neighbours(
    tiny_dir: Path, tmp_path: Path
) -> None:
    again = write_random_checkpoint(
        "tiny", tmp_path / "again", seed=0, max_shard_bytes=SHARD_BUDGET
    )
    for file in sorted(tiny_dir.iterdir()):
        assert (again / file.name).read_bytes() == file.read_bytes(), file.name

    other = write_random_checkpoint(
        "tiny", tmp_path / "other", seed=1, max_shard_bytes=SHARD_BUDGET
    )
    assert (other / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()
    shard = _index(tiny_dir)["weight_map"]["embed.weight"]
    assert (other / shard).read_bytes() != (tiny_dir / shard).read_bytes()

    # Text only, one shard: other tensors and shard boundaries change, every tensor stays equal.
    text = write_random_checkpoint("tiny", tmp_path / "text", seed=0, include_dspark=False)
    full, text_only = _stored_tensors(tiny_dir), _stored_tensors(text)
    assert set(text_only) < set(full)
    for name, tensor in text_only.items():
        assert torch.equal(tensor.view(torch.uint8), full[name].view(torch.uint8)), name


def test_random_values_have_the_intended_scales(tiny_dir: Path) -> None:
    stored = _stored_tensors(tiny_dir)
    norm = stored["layers.0.attn_norm.weight"].float()
    assert (norm - 1).abs().max() < 0.15
    sinks = torch.cat([t for name, t in stored.items() if name.endswith("attn_sink")])
    assert sinks.dtype == torch.float32 and 0.6 < sinks.std() < 1.5  # 44 draws of N(0, 1)
    hc_scale = stored["layers.0.hc_attn_scale"]
    assert hc_scale.abs().max() < 0.5
    wq_b = fp8_block_dequantize(
        stored["layers.0.attn.wq_b.weight"], stored["layers.0.attn.wq_b.scale"]
    )
    assert abs(wq_b.std().item() * math.sqrt(wq_b.shape[1]) - 1) < 0.1  # N(0, 1/fan_in)


# ---- loading ----------------------------------------------------------------------------------


def test_load_reproduces_the_stored_weights_bit_exactly(tiny_dir: Path) -> None:
    cfg = preset_config("tiny")
    loaded = load_checkpoint(tiny_dir, progress=False, keep_quantized=True)
    assert loaded.config == cfg and loaded.path == tiny_dir
    stored = _stored_tensors(tiny_dir)
    specs = full_inventory(cfg)
    expected_keys = {s.name for s in specs} | {s.scale_name for s in specs if s.kind == "fp8_rows"}
    assert set(loaded.tensors) == expected_keys
    assert set(loaded.quantized) == {s.name for s in specs if s.kind in ("fp8", "mxfp4")}

    for spec in specs:
        got = loaded.tensors[spec.name]
        raw = stored[spec.name]
        if spec.kind in ("bf16", "f32"):
            assert got.dtype == torch.float32 and torch.equal(got, raw.float()), spec.name
        elif spec.kind == "fp8_rows":
            assert torch.equal(got.view(torch.uint8), raw.view(torch.uint8))
            scale = loaded.tensors[spec.scale_name]
            assert torch.equal(scale.view(torch.uint8), stored[spec.scale_name].view(torch.uint8))
        else:
            scale = stored[spec.scale_name]
            if spec.kind == "fp8":
                assert torch.equal(got, fp8_block_dequantize(raw, scale, block=32)), spec.name
                again = fp8_block_quantize(got, block=32)
            else:
                assert torch.equal(got, mxfp4_dequantize(raw, scale)), spec.name
                again = mxfp4_quantize(got)
            for requantized, original in zip(again, (raw, scale), strict=True):
                assert torch.equal(requantized.view(torch.uint8), original.view(torch.uint8))
            kept_weight, kept_scale = loaded.quantized[spec.name]
            assert torch.equal(kept_weight.view(torch.uint8), raw.view(torch.uint8))
            assert torch.equal(kept_scale.view(torch.uint8), scale.view(torch.uint8))


def test_load_dtype_keeps_mixing_sink_and_router_biases_in_fp32(tiny_dir: Path) -> None:
    loaded = load_checkpoint(tiny_dir, dtype=torch.bfloat16, include_dspark=False, progress=False)
    assert not any(name.startswith("mtp.") for name in loaded.tensors)
    for name, tensor in loaded.tensors.items():
        if name.endswith("engram.embed.weight"):
            assert tensor.dtype == torch.float8_e4m3fn
        elif name.endswith("engram.embed.scale"):
            assert tensor.dtype == torch.float8_e8m0fnu
        else:
            assert tensor.dtype == (torch.float32 if keeps_fp32(name) else torch.bfloat16), name
    assert loaded.tensors["layers.0.ffn.gate.bias_vl"].dtype == torch.float32
    assert loaded.tensors["layers.0.hc_ffn_fn"].dtype == torch.float32
    assert loaded.tensors["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16


def test_vision_tensors_are_skipped(tiny_copy: Path) -> None:
    extra = {
        "vision.blocks.0.attn.wqkv.weight": torch.zeros(6, 4, dtype=torch.bfloat16),
        "aligner.w1.bias": torch.zeros(64, dtype=torch.bfloat16),
        "image_newline": torch.zeros(64, dtype=torch.bfloat16),
    }
    shard = _rewrite_shard(tiny_copy, "norm.weight", lambda t: t.update(extra))
    index = _index(tiny_copy)
    index["weight_map"].update(dict.fromkeys(extra, shard.name))
    (tiny_copy / INDEX).write_text(json.dumps(index))
    loaded = load_checkpoint(tiny_copy, progress=False)
    assert not set(extra) & set(loaded.tensors)


def test_text_only_checkpoint_needs_include_dspark_false(tmp_path: Path) -> None:
    folder = write_random_checkpoint("tiny", tmp_path, include_dspark=False)
    message = _load_error(folder)
    assert "missing tensor mtp." in message and "... and" in message
    load_checkpoint(folder, include_dspark=False, progress=False)


# ---- damaged checkpoints ----------------------------------------------------------------------


def test_truncated_shard_names_the_shard(tiny_copy: Path) -> None:
    shard = _shard_of(tiny_copy, "layers.3.attn.wq_a.weight")
    shard.write_bytes(shard.read_bytes()[:-100])
    message = _load_error(tiny_copy)
    assert shard.name in message and "truncated" in message


def test_corrupted_header_names_the_shard(tiny_copy: Path) -> None:
    shard = _shard_of(tiny_copy, "embed.weight")
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\xff" * 32
    shard.write_bytes(bytes(data))
    message = _load_error(tiny_copy)
    assert shard.name in message and "corrupted" in message


def test_missing_shard_file_names_the_file(tiny_copy: Path) -> None:
    shard = _shard_of(tiny_copy, "head.weight")
    shard.unlink()
    message = _load_error(tiny_copy)
    assert shard.name in message and "missing" in message


def test_missing_tensor_is_named(tiny_copy: Path) -> None:
    name = "layers.2.attn.wkv.scale"
    _rewrite_shard(tiny_copy, name, lambda t: t.pop(name))
    message = _load_error(tiny_copy)
    assert f"missing tensor {name}" in message


def test_wrong_shape_is_named(tiny_copy: Path) -> None:
    name = "layers.1.attn.kv_norm.weight"
    _rewrite_shard(
        tiny_copy, name, lambda t: t.update({name: torch.ones(63, dtype=torch.bfloat16)})
    )
    message = _load_error(tiny_copy)
    assert f"wrong shape for {name}" in message and "[63]" in message


def test_unexpected_tensor_is_named(tiny_copy: Path) -> None:
    name = "layers.0.attn.mystery.weight"
    _rewrite_shard(tiny_copy, "norm.weight", lambda t: t.update({name: torch.zeros(2)}))
    message = _load_error(tiny_copy)
    assert f"unexpected tensor {name}" in message


def test_all_problems_are_reported_in_one_error(tiny_copy: Path) -> None:
    def damage(tensors: dict[str, torch.Tensor]) -> None:
        tensors.pop("layers.0.attn.wq_a.weight")
        tensors["layers.0.attn.attn_sink"] = tensors["layers.0.attn.attn_sink"].double()
        tensors["layers.0.hc_attn_fn"] = tensors["layers.0.hc_attn_fn"].T.contiguous()
        tensors["layers.0.bogus"] = torch.zeros(1)

    _rewrite_shard(tiny_copy, "layers.0.attn.wq_a.weight", damage)
    message = _load_error(tiny_copy)
    assert "missing tensor layers.0.attn.wq_a.weight" in message
    assert "wrong dtype for layers.0.attn.attn_sink" in message and "F64" in message
    assert "wrong shape for layers.0.hc_attn_fn" in message
    assert "unexpected tensor layers.0.bogus" in message


def test_long_problem_lists_are_truncated(tiny_copy: Path) -> None:
    _rewrite_shard(tiny_copy, "layers.2.attn_norm.weight", lambda t: t.clear())
    message = _load_error(tiny_copy)
    listed = [line for line in message.splitlines() if line.startswith("  ")]
    assert len(listed) == 21 and re.fullmatch(r"  \.\.\. and \d+ more", listed[-1])


# ---- hub ids ----------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["offline", "unreachable_endpoint"])
def test_unreachable_hub_id_gives_a_clear_error_fast(
    failure: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants as hub

    # The hub reads HF_HUB_OFFLINE / HF_ENDPOINT once at import; patch what those set.
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    if failure == "offline":
        monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    else:
        monkeypatch.setattr(hub, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused
    hub_id = "deepseek-ai/DeepSeek-V4.1-Flash"
    start = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(hub_id, progress=False)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "could not be reached" in message and hub_id in message
    assert "local checkpoint folder" in message


def test_path_that_is_neither_folder_nor_hub_id(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="neither an existing local folder"):
        resolve_model_path(tmp_path / "does" / "not" / "exist")
    assert resolve_model_path(tmp_path) == tmp_path


# ---- the embedded default model --------------------------------------------------------------


def test_default_preset_without_dspark_writes_and_loads(tmp_path: Path) -> None:
    cfg = preset_config("default")
    start = time.monotonic()
    folder = write_random_checkpoint("default", tmp_path, include_dspark=False)
    loaded = load_checkpoint(folder, include_dspark=False, progress=False)
    assert time.monotonic() - start < 30
    assert (folder / "tokenizer.json").is_file()
    assert loaded.tensors["embed.weight"].shape == (cfg.vocab_size, cfg.hidden_size)
    rows = cfg.engram_num_embeddings[0]
    table = loaded.tensors[f"layers.{cfg.engram_layer_ids[0]}.engram.embed.weight"]
    assert table.shape == (rows, cfg.engram_head_dim) and table.dtype == torch.float8_e4m3fn
    total = sum(stored_nbytes(spec, 32) for spec in text_inventory(cfg))
    assert _index(folder)["metadata"]["total_size"] == total


# ---- GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_quantisation_and_loading_match_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_gpu = write_random_checkpoint("default", tmp_path / "gpu")  # quantises on the GPU
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        on_cpu = write_random_checkpoint("default", tmp_path / "cpu")
    for file in sorted(on_cpu.iterdir()):
        assert (on_gpu / file.name).read_bytes() == file.read_bytes(), file.name

    from_gpu = load_checkpoint(on_gpu, device="cuda", progress=False).tensors
    from_cpu = load_checkpoint(on_cpu, progress=False).tensors
    assert set(from_gpu) == set(from_cpu)
    for name, tensor in from_cpu.items():
        assert from_gpu[name].is_cuda
        same_bits = torch.equal(from_gpu[name].cpu().view(torch.uint8), tensor.view(torch.uint8))
        assert same_bits, name


def test_rewriting_a_folder_replaces_its_shards(tiny_copy: Path) -> None:
    write_random_checkpoint("tiny", tiny_copy)  # one shard instead of several
    shards = sorted(p.name for p in tiny_copy.glob("model-*"))
    assert shards == ["model-00001-of-00001.safetensors"]
    load_checkpoint(tiny_copy, progress=False)


def test_first_generation_reports_its_progress(tmp_path, caplog):
    """A preset's first generation says what it writes, shard by shard; the second says nothing."""
    from engine.models.embedded import ensure_embedded_checkpoint

    with caplog.at_level(logging.INFO, logger="engine.models"):
        ensure_embedded_checkpoint("tiny", tmp_path)
    messages = [record.getMessage() for record in caplog.records]
    assert any("generating the `tiny` checkpoint once" in m for m in messages)
    assert any(m.startswith("checkpoint shard 1/1 written") for m in messages)
    assert any("`tiny` checkpoint ready" in m for m in messages)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.models"):
        ensure_embedded_checkpoint("tiny", tmp_path)
    assert caplog.records == []
