"""The EP MoE layer with the grouped local-expert path inside dispatch/combine: on CUDA over
NCCL, and on the CPU over gloo with the kernels in Triton's interpreter.

Each rank builds the same MXFP4 layer (16 experts, top-6) and its EP shard, packs both, and runs
its own tokens (uneven; a rank may have none) through:

* fast mode, `all_to_all` and `fixed_capacity` one-pass: the single-process layer's output
  within the kernel's rounding;
* batch-invariant mode (ordered combine, fixed tiles): bitwise the EP-1 layer's (`local`
  dispatcher: the same combine order) and the single-process layer's (`_routed_slots`, then
  `sum_by_expert_id`: the same expert-id order);
* `fixed_capacity` one-pass: no host sync in the whole layer (CUDA sync debug mode "error").

One GPU runs the EP-1 group (world size 1, the same code paths); two GPUs the EP2 group; the CPU
an EP2 group of spawned gloo ranks, interpreted.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from engine.distributed.dispatch import DispatcherConfig, ExpertPlacement, build_dispatcher
from engine.distributed.groups import RankConfig, rank_groups
from engine.models.deepseek_v41.moe import MoE
from tests.distributed.spawn import run_ranks

DIM, INTER, EXPERTS, TOP_K, CAPACITY = 128, 64, 16, 6, 32
TOKENS = (9, 0, 29, 5)  # per rank


def _layer(dispatcher=None) -> MoE:
    torch.manual_seed(0)  # the same weights on every rank and for every variant
    moe = MoE(DIM, INTER, EXPERTS, TOP_K, 2.5, 7.0, torch.bfloat16, True, dispatcher)
    with torch.no_grad():
        for tensor in moe.buffers():
            if tensor.dtype == torch.int8:
                tensor.copy_(torch.randint(-128, 128, tensor.shape, dtype=torch.int8))
            else:
                tensor.copy_(
                    torch.randint(120, 124, tensor.shape).to(torch.uint8).view(tensor.dtype)
                )
        for parameter in moe.parameters():
            parameter.normal_(0.0, 0.05)
    return moe


def _packed(moe: MoE, full: MoE, device: torch.device) -> MoE:
    moe.load_state_dict(full.state_dict(), strict=False)  # a shard takes its experts only
    moe = moe.to(device)
    moe.pack_experts()
    return moe


def _rel(ours: torch.Tensor, reference: torch.Tensor) -> float:
    if not reference.numel():
        return 0.0
    return float((ours.float() - reference.float()).norm() / reference.float().norm())


def layer_checks(rank: int, world_size: int, port: int, device_type: str) -> dict[str, Any]:
    # NVLink multicast off: it can take a shared host's GPUs down
    os.environ.update(
        NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
    )
    torch.set_num_threads(1)
    config = RankConfig(
        rank, world_size, master_port=port, device_type=device_type, local_rank=rank
    )
    with rank_groups(config) as groups:
        device = torch.device(device_type, rank if device_type == "cuda" else None)
        full = _layer()
        single = _packed(_layer(), full, device)
        local = build_dispatcher(DispatcherConfig("local"), ExpertPlacement(EXPERTS, 1, 0), None)
        ep_one = _packed(_layer(local), full, device)
        placement = ExpertPlacement(EXPERTS, world_size, rank)
        configs = {
            "all_to_all": DispatcherConfig("all_to_all"),
            "one_pass": DispatcherConfig("fixed_capacity", capacity_tokens=CAPACITY, one_pass=True),
        }
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(TOKENS[rank], DIM, generator=gen).bfloat16().to(device)
        out: dict[str, Any] = {}
        for name, dispatcher_config in configs.items():
            dispatcher = build_dispatcher(dispatcher_config, placement, groups.ep)
            ep = _packed(_layer(dispatcher), full, device)
            with torch.no_grad():
                out[f"{name}/fast_rel"] = _rel(ep(x), single(x))
                ep.batch_invariant = ep_one.batch_invariant = single.batch_invariant = True
                invariant = ep(x)
                out[f"{name}/invariant_bitwise"] = torch.equal(invariant, ep_one(x))
                out[f"{name}/invariant_equals_one_process"] = torch.equal(invariant, single(x))
                ep.batch_invariant = ep_one.batch_invariant = single.batch_invariant = False
                if name == "one_pass" and device_type == "cuda":
                    ep(x)  # compiled and tuned: the next call only launches
                    torch.cuda.synchronize(device)
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        ep(x)
                        out["one_pass/no_host_sync"] = True
                    except RuntimeError as error:
                        out["one_pass/no_host_sync"] = str(error)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
        return out


def _check(results: list[dict[str, Any]], on_cuda: bool = True) -> None:
    for result in results:
        for name in ("all_to_all", "one_pass"):
            assert result[f"{name}/fast_rel"] < 1e-2, result
            assert result[f"{name}/invariant_bitwise"], result
            assert result[f"{name}/invariant_equals_one_process"], result
        if on_cuda:
            assert result["one_pass/no_host_sync"] is True, result


@pytest.mark.slow
def test_ep2_layer_over_gloo_in_the_triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by the spawned ranks' Triton
    _check(run_ranks(layer_checks, 2, "cpu", deadline_s=300), on_cuda=False)


@pytest.mark.gpu
def test_ep_layer_on_one_gpu() -> None:
    _check(run_ranks(layer_checks, 1, "cuda", deadline_s=300))


@pytest.mark.gpu
def test_ep2_layer_over_nccl() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _check(run_ranks(layer_checks, 2, "cuda", deadline_s=300))
