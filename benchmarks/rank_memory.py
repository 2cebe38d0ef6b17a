"""Weights per EP rank: the plan from the config's inventory against what a rank really holds.

    python benchmarks/rank_memory.py [--model default] [--device cuda] [--dtype bfloat16]
                                     [--ep 1 2 4 8]

For each EP size, loads rank 0 of the model on the device (no process group is needed to load
a shard) and prints the planned and held bytes by part and dtype, and the device memory the
load really took (CUDA: `torch.cuda.memory_allocated` before and after). On CUDA in bf16 the
routed experts stay MXFP4 and are packed for the grouped kernel (`pack_routed_experts`), the
case the CPU tests cannot see. Also prints the released model's per-rank plan at EP 8.
Exits 1 when a plan differs from what the rank holds.
"""

from __future__ import annotations

import argparse
import sys

import torch

from engine.async_engine import EngineConfig
from engine.distributed.expert_parallel import ExpertParallel
from engine.distributed.memory import (
    RELEASED_EP_SIZE,
    held_host_bytes,
    held_weight_bytes,
    plan_released,
    plan_weights,
)
from engine.models import load_model
from engine.models.embedded import resolve_model_source


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--engram-placement", default="auto", choices=["auto", "device", "host"])
    args = parser.parse_args()
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        engram_placement=args.engram_placement,
    )
    path = resolve_model_source(config.model)
    dtype = getattr(torch, config.dtype)
    failed = False
    for ep_size in args.ep:
        plan = plan_weights(config, path, ep_size)
        on_cuda = torch.device(args.device).type == "cuda"
        before = torch.cuda.memory_allocated() if on_cuda else 0
        model = load_model(
            path,
            device=args.device,
            dtype=dtype,
            progress=False,
            quantized_experts=config.quantized_experts,
            expert_parallel=ExpertParallel(0, ep_size) if ep_size > 1 else None,
            engram_placement=plan.engram_placement,
        )
        held, held_host = held_weight_bytes(model), held_host_bytes(model)
        allocated = torch.cuda.memory_allocated() - before if on_cuda else None
        print(f"EP {ep_size} planned: {plan.device.describe()}")
        print(f"EP {ep_size} held:    {held.describe()}")
        if plan.host.parts or held_host.parts:
            print(f"EP {ep_size} host, per node, planned: {plan.host.describe()}")
            print(f"EP {ep_size} host, per node, held:    {held_host.describe()}")
        if allocated is not None:
            print(f"EP {ep_size} allocated on {args.device}: {allocated:,} B")
        failed |= plan.device != held or plan.host != held_host
        del model
        if on_cuda:
            torch.cuda.empty_cache()
    released = plan_released(config)
    print(f"released at EP {RELEASED_EP_SIZE} per rank: {released.device.describe()}")
    print(f"released at EP {RELEASED_EP_SIZE} per node (host): {released.host.describe()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
