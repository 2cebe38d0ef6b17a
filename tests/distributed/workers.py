"""Code that runs inside spawned gloo ranks (`spawn.run_ranks`); results are small dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.distributed.coordinator import RankWork, StepCoordinator, gloo_int_gather
from engine.distributed.dispatch import (
    Dispatcher,
    DispatcherConfig,
    ExpertPlacement,
    build_dispatcher,
)
from engine.distributed.expert_parallel import ExpertParallel
from engine.distributed.groups import RankConfig, RankGroups, rank_groups
from engine.models import DeepseekV41ForCausalLM, Numerics, load_checkpoint, sequential_batch
from engine.models.deepseek_v41.checkpoint_loader import read_config, routed_expert_filter
from engine.models.deepseek_v41.engram import HostEngramTable
from engine.models.deepseek_v41.engram_store import map_engram_tables
from engine.models.deepseek_v41.loading import engram_token_map

HIDDEN, EXPERTS, TOP_K = 16, 8, 3
TIMEOUT_S = 30.0


def all_checks(rank: int, world_size: int, port: int, checkpoint: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    config = RankConfig(rank, world_size, master_port=port, timeout_s=TIMEOUT_S)
    with rank_groups(config) as groups:
        return {
            "coordinator": coordinator_checks(groups),
            "dispatch": dispatch_checks(groups),
            "model": model_checks(groups, Path(checkpoint)),
        }


# ---- lockstep ---------------------------------------------------------------------------------


def coordinator_checks(groups: RankGroups) -> dict[str, Any]:
    slept: list[float] = []
    coordinator = StepCoordinator(gloo_int_gather(groups.cpu), sleep=slept.append)
    rank = groups.rank
    works = [RankWork(rank + 1, 1), RankWork(0, 0) if rank else RankWork(3, 2), RankWork(0, 0)]
    agreements = [coordinator.agree(work) for work in works]
    return {
        "num_tokens": [a.num_tokens for a in agreements],
        "zero_token": [a.is_zero_token(rank) for a in agreements],
        "has_work": [a.has_work for a in agreements],
        "buckets": [a.bucket_for((1, 2, 4, 8)) for a in agreements],
        "slept": slept,
    }


# ---- dispatchers with an elementwise expert ---------------------------------------------------


def _tokens(rank: int) -> int:
    return (7, 0, 12, 3)[rank % 4]


def _routing(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    num_tokens = _tokens(rank)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    ids = torch.rand(num_tokens, EXPERTS, generator=gen).argsort(1)[:, :TOP_K]
    weights = torch.rand(num_tokens, TOP_K, generator=gen)
    return x, ids, weights


def _expert(x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """A row-wise 'expert': the result of a row depends only on that row and the expert id."""
    e = expert[:, None].float()
    return torch.tanh(x * (1.0 + 0.25 * e) + 0.1 * e)


def _reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Single-process MoE combine: a token's pairs added in ascending expert id from 0.0."""
    out = torch.zeros_like(x)
    order = ids.argsort(dim=1, stable=True)
    for j in range(ids.shape[1]):
        e = ids.gather(1, order[:, j : j + 1])[:, 0]
        w = weights.gather(1, order[:, j : j + 1])
        out = out + _expert(x, e) * w
    return out


def _run(dispatcher: Dispatcher, x, ids, weights, ordered: bool) -> torch.Tensor:
    recv = dispatcher.dispatch(x, ids, weights)
    row, local, weight = recv.pairs()
    global_ids = local + dispatcher.placement.first_expert
    pair_out = _expert(recv.x[row], global_ids) * weight[:, None]
    return dispatcher.combine(recv.slot_outputs(pair_out), recv, ordered)


def dispatch_checks(groups: RankGroups) -> dict[str, Any]:
    placement = ExpertPlacement(EXPERTS, groups.world_size, groups.rank)
    x, ids, weights = _routing(groups.rank)
    ref = _reference(x, ids, weights)
    configs = {
        "all_to_all": DispatcherConfig("all_to_all"),
        "fixed_big": DispatcherConfig("fixed_capacity", capacity_tokens=16),
        "fixed_tiny": DispatcherConfig("fixed_capacity", capacity_tokens=1),
        "fixed_one_pass": DispatcherConfig("fixed_capacity", capacity_tokens=12, one_pass=True),
    }
    out: dict[str, Any] = {"num_tokens": x.shape[0]}
    results = {}
    for name, config in configs.items():
        dispatcher = build_dispatcher(config, placement, groups.ep)
        for ordered in (False, True):
            y = _run(dispatcher, x, ids, weights, ordered)
            results[name, ordered] = y
            scale = max(ref.abs().max().item(), 1e-30) if len(ref) else 1.0
            out[f"{name}/{'ordered' if ordered else 'fast'}/rel"] = (
                (y - ref).abs().max().item() / scale if len(ref) else 0.0
            )
            out[f"{name}/{'ordered' if ordered else 'fast'}/exact"] = torch.equal(y, ref)
        out[f"{name}/passes"] = getattr(dispatcher, "num_passes_last", 1)
    for ordered in (False, True):
        tag = "ordered" if ordered else "fast"
        for name in ("fixed_big", "fixed_tiny", "fixed_one_pass"):
            out[f"{name}/{tag}/equals_all_to_all"] = torch.equal(
                results[name, ordered], results["all_to_all", ordered]
            )
    return out


# ---- the tiny model: EP forward against one process -------------------------------------------


def _scenario(world_size: int) -> list[list[list[tuple[int, int, list[int]]]]]:
    """steps[s][rank] = the rank's batch entries (slot, start position, tokens) of step s.

    Step 0 prefills uneven prompts (the last rank has none: a zero-token step), step 1 decodes
    them while the last rank prefills, step 2 leaves rank 0 idle, step 3 leaves every rank idle.
    """

    def token(rank: int, slot: int, pos: int) -> int:
        return (131 * rank + 17 * slot + 7 * pos + 1) % 1000

    prompts = {
        r: ([9, 4], [17], [3, 5, 2])[r % 3] if r < world_size - 1 else [] for r in range(world_size)
    }
    lengths = {r: list(p) for r, p in prompts.items()}
    steps = []
    step0 = [
        [(s, 0, [token(r, s, p) for p in range(n)]) for s, n in enumerate(prompts[r])]
        for r in range(world_size)
    ]
    steps.append(step0)
    step1 = []
    for r in range(world_size):
        if lengths[r]:
            step1.append([(s, n, [token(r, s, n)]) for s, n in enumerate(lengths[r])])
            lengths[r] = [n + 1 for n in lengths[r]]
        else:
            step1.append([(0, 0, [token(r, 0, p) for p in range(6)])])
            lengths[r] = [6]
    steps.append(step1)
    steps.append(
        [
            [] if r == 0 else [(s, n, [token(r, s, n)]) for s, n in enumerate(lengths[r])]
            for r in range(world_size)
        ]
    )
    steps.append([[] for _ in range(world_size)])
    return steps


def _batch(entries: list[tuple[int, int, list[int]]]):
    slots = [slot for slot, _, _ in entries]
    table = torch.tensor([[slot] for slot in slots], dtype=torch.long)
    return sequential_batch([t for _, _, t in entries], [p for _, p, _ in entries], slots, table)


@torch.inference_mode()
def _replay(model, steps, rank: int, coordinator: StepCoordinator | None) -> list[Any]:
    state = model.allocate_state(num_slots=4, num_blocks=4)
    logits = []
    for step in steps:
        entries = step[rank]
        num_tokens = sum(len(t) for _, _, t in entries)
        if coordinator is not None:
            agreement = coordinator.agree(RankWork(num_tokens, len(entries)))
            expect = tuple(sum(len(t) for _, _, t in s) for s in step)
            if agreement.num_tokens != expect:
                raise AssertionError(f"agreed {agreement.num_tokens}, scenario says {expect}")
            if agreement.is_zero_token(rank):
                model.zero_token_step()
        if entries:
            logits.append(model.forward_step(_batch(entries), state).logits)
        else:
            logits.append(None)
    return logits


def _compare(got: list[Any], want: list[Any]) -> tuple[bool, float]:
    exact, worst = True, 0.0
    for a, b in zip(got, want, strict=True):
        if (a is None) != (b is None):
            return False, float("inf")
        if a is None:
            continue
        exact &= torch.equal(a, b)
        worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    return exact, worst


def _from_checkpoint(checkpoint: Path, ep: ExpertParallel | None):
    """The model of one rank from a partial checkpoint read, built on the CPU (`load_model`'s
    `meta` construction costs each fresh process seconds of torch imports; it is tested in
    process by `test_units`)."""
    config = read_config(checkpoint)
    include = (
        None if ep is None else routed_expert_filter(ep.placement(config.n_routed_experts).owns)
    )
    loaded = load_checkpoint(checkpoint, progress=False, include=include)
    model = DeepseekV41ForCausalLM(config, expert_parallel=ep)
    model.load_state_dict(loaded.tensors, strict=True)
    model.set_engram_token_map(torch.from_numpy(engram_token_map(checkpoint, config)))
    return model.eval()


def _rebuild(source, numerics: Numerics, ep: ExpertParallel | None):
    """`source`'s weights in a model with other numerics or another dispatcher."""
    model = DeepseekV41ForCausalLM(source.config, numerics=numerics, expert_parallel=ep)
    model.load_state_dict(source.state_dict(), strict=True)
    model.set_engram_token_map(source.engram_token_map)
    return model.eval()


def _with_host_engram(model, checkpoint: Path):
    """`model` with its Engram tables mapped from the checkpoint's shards (the `host`
    placement, as `load_model(..., engram_placement="host")` attaches them)."""
    mapped = map_engram_tables(Path(checkpoint), model.config)
    model.attach_host_engram({lid: HostEngramTable(*parts) for lid, parts in mapped.items()})
    return model


@torch.inference_mode()
def _moe_layer_rel(model, reference, rank: int) -> float:
    """Worst relative difference of each MoE layer's output on the same inputs (the rank's own
    token count; the zero-token rank joins with none)."""
    worst = 0.0
    for index, (block, ref_block) in enumerate(zip(model.layers, reference.layers, strict=True)):
        gen = torch.Generator().manual_seed(1000 * rank + index)
        x = torch.randn(_tokens(rank), model.config.hidden_size, generator=gen)
        got, want = block.ffn(x), ref_block.ffn(x)
        if len(x):
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return worst


def model_checks(groups: RankGroups, checkpoint: Path) -> dict[str, Any]:
    """EP models against the one-process model. Two `load_model` calls per rank (the full
    reference and this rank's EP shard); the other variants reuse their weights."""
    rank, steps = groups.rank, _scenario(groups.world_size)
    fast, invariant = Numerics(), Numerics(moe_batch_invariant=True)
    a2a = ExpertParallel.from_groups(groups, DispatcherConfig("all_to_all"))
    fixed_big = ExpertParallel.from_groups(groups, DispatcherConfig("fixed_capacity", 64))
    fixed_overflow = ExpertParallel.from_groups(groups, DispatcherConfig("fixed_capacity", 2))
    reference = _from_checkpoint(checkpoint, None)
    shard = _from_checkpoint(checkpoint, a2a)
    models = {
        "fast/all_to_all": _rebuild(shard, fast, a2a),
        "fast/fixed_big": _rebuild(shard, fast, fixed_big),
        "invariant/all_to_all": _rebuild(shard, invariant, a2a),
        "invariant/fixed_overflow": _rebuild(shard, invariant, fixed_overflow),
        "invariant/all_to_all/host_engram": _with_host_engram(
            _rebuild(shard, invariant, a2a), checkpoint
        ),
    }
    # NOTE: every compared model is rebuilt (fresh parameter storage): the same weights in the
    # storage a loader produced can round ~1e-7 differently in BLAS (seen on one rank), which
    # would blur the fast-mode comparisons of dispatchers.
    references = {
        mode: _rebuild(reference, numerics, None)
        for mode, numerics in (("fast", fast), ("invariant", invariant))
    }
    out: dict[str, Any] = {
        "loaded_experts": sorted(
            {
                int(key.split(".")[4])
                for key in shard.state_dict()
                if key.startswith("layers.0.ffn.experts.")
            }
        ),
        "dspark_experts": len(shard.mtp[0].ffn.experts),
        "moe_layer_rel": _moe_layer_rel(shard, reference, rank),
        "tokens_per_step": [sum(len(t) for _, _, t in step[rank]) for step in steps],
    }
    wants = {mode: _replay(model, steps, rank, None) for mode, model in references.items()}
    gots = {}
    for name, model in models.items():
        coordinator = StepCoordinator(gloo_int_gather(groups.cpu), sleep=lambda s: None)
        gots[name] = _replay(model, steps, rank, coordinator)
        exact, rel = _compare(gots[name], wants[name.split("/")[0]])
        out[f"{name}/exact"], out[f"{name}/rel"] = exact, rel
    out["host_engram_tables"] = sorted(
        models["invariant/all_to_all/host_engram"].host_engram_tables()
    )
    out["host_engram/equals_device"] = _compare(
        gots["invariant/all_to_all/host_engram"], gots["invariant/all_to_all"]
    )[0]
    out["fast/fixed_big/equals_all_to_all"] = _compare(
        gots["fast/fixed_big"], gots["fast/all_to_all"]
    )[0]
    return out
