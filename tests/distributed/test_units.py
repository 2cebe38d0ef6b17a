"""In-process checks of the distributed pieces (no process groups)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.distributed.coordinator import LockstepError, RankWork, StepCoordinator
from engine.distributed.dispatch import (
    DispatcherConfig,
    ExpertPlacement,
    build_dispatcher,
    plan_send,
)
from engine.distributed.expert_parallel import ExpertParallel
from engine.distributed.groups import RankConfig
from engine.models import CheckpointError, DeepseekV41ForCausalLM, load_checkpoint, load_model
from engine.models.deepseek_v41.checkpoint_loader import routed_expert_filter
from engine.models.deepseek_v41.config import preset_config


class FakeGroup:
    """Rows of the other ranks are fixed; this rank's row is inserted at `rank`."""

    def __init__(self, rank: int, others: list[list[int]]) -> None:
        self.rank, self.others, self.calls = rank, others, 0

    def __call__(self, values):
        self.calls += 1
        rows = [list(row) for row in self.others]
        rows.insert(self.rank, list(values))
        return rows


def test_coordinator_backs_off_while_idle_and_resets_on_work() -> None:
    slept: list[float] = []
    fake = FakeGroup(0, [[0, 0, 0, 0]])
    coordinator = StepCoordinator(
        fake, idle_sleep_s=0.01, max_idle_sleep_s=0.03, sleep=slept.append
    )
    for step in range(4):
        fake.others = [[step, 0, 0, 0]]
        assert not coordinator.agree(RankWork(0, 0)).has_work
    assert slept == [0.01, 0.02, 0.03, 0.03]
    fake.others = [[4, 5, 1, 0]]
    agreement = coordinator.agree(RankWork(0, 0))
    assert agreement.is_zero_token(0) and agreement.num_tokens == (0, 5)
    fake.others = [[5, 0, 0, 0]]
    coordinator.agree(RankWork(0, 0))
    assert slept[-1] == 0.01  # work reset the backoff


def test_coordinator_raises_when_ranks_are_in_different_steps() -> None:
    coordinator = StepCoordinator(FakeGroup(1, [[7, 1, 1, 0]]), sleep=lambda s: None)
    with pytest.raises(LockstepError, match="different steps"):
        coordinator.agree(RankWork(1, 1))


def test_rank_work_and_rank_config_validation() -> None:
    with pytest.raises(ValueError):
        RankWork(3, 0)
    with pytest.raises(ValueError, match="outside"):
        RankConfig(rank=2, world_size=2)
    with pytest.raises(ValueError, match="device type"):
        RankConfig(rank=0, world_size=1, device_type="tpu")
    assert RankConfig(0, 1).backend == "gloo" and RankConfig(0, 1, device_type="cuda").backend == (
        "nccl"
    )


def test_placement_rejects_experts_not_divisible_by_ep_size() -> None:
    with pytest.raises(ValueError, match="cannot be split over 3 EP ranks"):
        ExpertPlacement(8, 3, 0)
    assert list(ExpertPlacement(8, 4, 3).local_experts) == [6, 7]


def test_dispatcher_config_is_a_registry_lookup() -> None:
    with pytest.raises(ValueError, match="unknown dispatcher"):
        DispatcherConfig("nvshmem")
    with pytest.raises(ValueError, match="capacity_tokens"):
        DispatcherConfig("fixed_capacity")
    with pytest.raises(ValueError, match="capacity_tokens"):
        DispatcherConfig("all_to_all", capacity_tokens=4)


def test_one_pass_dispatch_refuses_more_tokens_than_its_capacity_before_any_collective() -> None:
    config = DispatcherConfig("fixed_capacity", capacity_tokens=2, one_pass=True)
    dispatcher = build_dispatcher(config, ExpertPlacement(8, 2, 0), None)  # no group: never used
    with pytest.raises(ValueError, match="exceed the one-pass capacity of 2"):
        dispatcher.dispatch(
            torch.zeros(3, 4), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
        )
    with pytest.raises(ValueError, match="one_pass"):
        DispatcherConfig("all_to_all", one_pass=True)


def test_send_plan_ships_each_token_once_per_destination() -> None:
    placement = ExpertPlacement(8, 4, 0)  # rank r owns experts 2r, 2r + 1
    ids = torch.tensor([[0, 1, 6], [2, 7, 3], [5, 4, 0]])
    plan = plan_send(ids, placement)
    assert plan.send_counts.tolist() == [2, 1, 1, 2]
    assert plan.token.tolist() == [0, 2, 1, 2, 0, 1]  # grouped by rank, tokens ascending
    # Token 0 goes to rank 0 once, carrying both its rank-0 experts as local ids 0 and 1.
    assert plan.local_ids[0].tolist() == [0, 1, -1]
    assert plan.local_ids[5].tolist() == [-1, 1, -1]  # token 1 at rank 3: expert 7 → local 1


def test_ordered_combine_sums_in_expert_id_order_not_slot_order() -> None:
    dispatcher = build_dispatcher(DispatcherConfig("local"), ExpertPlacement(4, 1, 0), None)
    x = torch.tensor([[1.0], [2.0]])
    ids = torch.tensor([[3, 1, 0], [1, 2, 0]])
    weights = torch.tensor([[1e8, -1e8, 1.0], [1.0, 1.0, 1.0]])
    recv = dispatcher.dispatch(x, ids, weights)
    row, _, weight = recv.pairs()
    slot_out = recv.slot_outputs(recv.x[row] * weight[:, None])
    # fp32, experts ascending: (1 + −1e8) + 1e8 = 0; slot order: (1e8 − 1e8) + 1 = 1.
    assert dispatcher.combine(slot_out, recv, ordered=True)[:, 0].tolist() == [0.0, 6.0]
    assert dispatcher.combine(slot_out, recv, ordered=False)[:, 0].tolist() == [1.0, 6.0]


def test_partial_read_keeps_only_the_chosen_routed_experts(tiny_checkpoint: Path) -> None:
    loaded = load_checkpoint(
        tiny_checkpoint, progress=False, include=routed_expert_filter(lambda e: e in (2, 3))
    )
    layer = {name.split(".")[4] for name in loaded.tensors if ".ffn.experts." in name}
    assert layer >= {"2", "3"}  # DSpark (mtp.*) experts stay whole
    target = {
        name.split(".")[4] for name in loaded.tensors if name.startswith("layers.1.ffn.experts.")
    }
    assert target == {"2", "3"}
    assert any(name.startswith("mtp.0.ffn.experts.3.") for name in loaded.tensors)


def test_loading_an_ep_rank_of_a_non_divisible_size_fails_clearly(tiny_checkpoint: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot be split over 3 EP ranks"):
        load_model(tiny_checkpoint, progress=False, expert_parallel=ExpertParallel(1, 3))
    with pytest.raises(ValueError, match="cannot be split over 3 EP ranks"):
        DeepseekV41ForCausalLM(preset_config("tiny"), expert_parallel=ExpertParallel(0, 3))


def test_ep_size_one_equals_the_untouched_local_path(tiny_checkpoint: Path) -> None:
    local = ExpertParallel(0, 1, None, DispatcherConfig("local"))
    plain = load_model(tiny_checkpoint, progress=False)
    sharded = load_model(tiny_checkpoint, progress=False, expert_parallel=local)
    tokens = [[5, 9, 200, 3, 3, 41, 7], [8, 1]]
    assert torch.equal(sharded.logits(tokens), plain.logits(tokens))


def test_load_model_of_an_ep_rank_reads_only_its_experts(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint, progress=False, expert_parallel=ExpertParallel(1, 2))
    names = model.state_dict()
    for layer in range(model.config.num_hidden_layers):
        experts = {
            int(n.split(".")[4]) for n in names if n.startswith(f"layers.{layer}.ffn.experts.")
        }
        assert experts == {4, 5, 6, 7}
    assert len(model.mtp[0].ffn.experts) == model.config.dspark_n_routed_experts


def test_any_rank_asking_to_stop_stops_every_rank_in_the_same_step() -> None:
    slept: list[float] = []
    coordinator = StepCoordinator(FakeGroup(0, [[0, 5, 1, 1]]), sleep=slept.append)
    agreement = coordinator.agree(RankWork(3, 1))
    assert agreement.stop and not agreement.has_work and not agreement.is_zero_token(0)
    assert slept == []  # stopping does not sleep
    coordinator = StepCoordinator(FakeGroup(0, [[0, 5, 1, 0]]), sleep=slept.append)
    assert not coordinator.agree(RankWork(0, 0)).stop


def test_parallel_config_validation() -> None:
    from engine.distributed.config import ParallelConfig
    from server.cli import build_parser, config_from_args

    with pytest.raises(ValueError, match="multiple of nnodes"):
        ParallelConfig(ep_size=3, nnodes=2, master_port=29500)
    with pytest.raises(ValueError, match="explicit master_port"):
        ParallelConfig(ep_size=4, nnodes=2)
    with pytest.raises(ValueError, match="node_rank"):
        ParallelConfig(ep_size=4, nnodes=2, node_rank=2, master_port=29500)
    parallel = ParallelConfig(ep_size=16, nnodes=2, node_rank=1, master_port=29500)
    assert parallel.local_ranks == range(8, 16) and parallel.engine_port == 29501
    args = build_parser().parse_args(
        ["--ep", "8", "--nnodes", "2", "--node-rank", "1", "--master-port", "29600"]
    )
    got = config_from_args(args).parallel
    assert (got.ep_size, got.nnodes, got.node_rank, got.master_port) == (8, 2, 1, 29600)


@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("ep_size", [1, 2])
def test_planned_weight_bytes_equal_what_each_rank_loads(
    tiny_checkpoint: Path, ep_size, placement
) -> None:
    from engine.distributed.memory import (
        held_host_bytes,
        held_weight_bytes,
        planned_host_bytes,
        planned_weight_bytes,
    )
    from engine.models.deepseek_v41.checkpoint_loader import read_config

    cfg = read_config(tiny_checkpoint)
    plan = planned_weight_bytes(cfg, ep_size, torch.float32, engram_placement=placement)
    host = planned_host_bytes(cfg, placement)
    for rank in range(ep_size):
        ep = ExpertParallel(rank, ep_size) if ep_size > 1 else None
        model = load_model(
            tiny_checkpoint, progress=False, expert_parallel=ep, engram_placement=placement
        )
        assert held_weight_bytes(model) == plan
        assert held_host_bytes(model) == host
        owns = ExpertPlacement(8, ep_size, rank).local_experts
        tensors = load_checkpoint(
            tiny_checkpoint, progress=False, include=routed_expert_filter(owns.__contains__)
        ).tensors
        assert plan.total + host.total == sum(
            t.numel() * t.element_size() for t in tensors.values()
        )
        engram = sum(
            t.numel() * t.element_size() for n, t in tensors.items() if ".engram.embed." in n
        )
        assert host.total == (engram if placement == "host" else 0) and engram > 0
        experts = sum(
            t.numel() * t.element_size()
            for n, t in tensors.items()
            if ".ffn.experts." in n and n.startswith("layers.")
        )
        assert plan.part("experts") == experts


def test_released_model_per_rank_at_ep8_comes_from_its_inventory() -> None:
    from engine.distributed.memory import planned_host_bytes, planned_weight_bytes
    from engine.models.deepseek_v41.config import config_with

    cfg = config_with()
    mxfp4 = planned_weight_bytes(cfg, 8, torch.bfloat16, quantized_experts=True)
    # 48 of 384 experts per layer, 40 layers, each (w1, w3: [2304, 2560/2] + w2: [5120, 1152/2]
    # int8, one e8m0 scale per 32 values): scaleout.md §1.1's 18,800,640 B per expert.
    assert mxfp4.part("experts") == 48 * 40 * 18_800_640
    dense = planned_weight_bytes(cfg, 8, torch.bfloat16)
    assert dense.part("experts") == 48 * 40 * 3 * 2304 * 5120 * 2  # dequantised to bf16
    assert dense.part("engram") == mxfp4.part("engram") > 0  # FP8 rows, replicated per rank
    # Host placement: the tables leave the rank (188.8 GiB) for one copy per node, and a rank
    # of the released model fits an H200 (141 GB) with room for KV.
    host = planned_weight_bytes(cfg, 8, torch.bfloat16, True, engram_placement="host")
    tables = planned_host_bytes(cfg, "host")
    assert host.part("engram") == 0 and tables.total == mxfp4.part("engram")
    assert host.total == mxfp4.total - tables.total
    assert round(tables.total / 2**30, 1) == 188.8  # 2 × (384 M rows × (256 + 8) B)
    assert host.total < 60 * 2**30 < 141e9 - 60e9
    with pytest.raises(ValueError, match="cannot be split over 5 EP ranks"):
        planned_weight_bytes(cfg, 5, torch.bfloat16)


def test_weights_that_do_not_fit_say_how_much_is_needed() -> None:
    from engine.distributed.memory import InsufficientMemoryError, check_memory

    check_memory(3 << 30, 8 << 30, "cuda:0", num_ranks=2)
    with pytest.raises(
        InsufficientMemoryError,
        match=r"has 5.00 GiB free, but the weights need 2 ranks × 3.00 GiB = 6.00 GiB",
    ):
        check_memory(3 << 30, 5 << 30, "the host", num_ranks=2)
    check_memory(3 << 30, 8 << 30, "the host", num_ranks=2, shared=2 << 30)
    with pytest.raises(
        InsufficientMemoryError,
        match=r"need 2 ranks × 3.00 GiB \+ 3.00 GiB shared = 9.00 GiB",
    ):
        check_memory(3 << 30, 8 << 30, "the host", num_ranks=2, shared=3 << 30)


def test_a_non_dividing_ep_size_is_refused_before_any_rank_starts() -> None:
    from engine.async_engine import EngineConfig
    from engine.client import build_engine_client
    from engine.distributed.config import ParallelConfig

    started = time.monotonic()
    with pytest.raises(ValueError, match="--ep 3 cannot serve .*8 routed experts cannot be split"):
        build_engine_client(EngineConfig(model="tiny"), ParallelConfig(ep_size=3))
    assert time.monotonic() - started < 5  # refused from config.json: nothing was spawned


def test_the_cli_refuses_a_non_dividing_ep_size_and_engine_options_on_other_nodes() -> None:
    from server.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--model", "tiny", "--ep", "3", "--device", "cpu"])
    assert exited.value.code == 2
    worker = ["--nnodes", "2", "--node-rank", "1", "--ep", "2", "--master-port", "29600"]
    with pytest.raises(SystemExit) as exited:
        main([*worker, "--model", "tiny", "--max-num-seqs", "4"])
    assert exited.value.code == 2
