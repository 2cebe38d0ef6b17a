"""One EP8 rank's routed experts on what it received: the per-expert loop against the grouped
MXFP4 kernel (`MoE.run_local_experts`), µs per MoE layer and host syncs.

    python3 benchmarks/ep_local_experts.py [--decode 16 64 256] [--prefill 4096] [--repeats 20]

The rank is rank 0 of EP8 over the released 384 experts (48 local, top-6, hidden 5120, expert
width 2304, MXFP4 weights drawn on the GPU as `random_init` draws them). Each of the 8 ranks
holds T tokens (T = the decode batch, or the prefill chunk) routed uniformly at random; the
rank receives every token with at least one of its experts, with its 6 (local id or −1, weight)
pairs: the `RecvBatch` the dispatcher would hand it (≈ 3.86/8 of the 8T tokens, 6T/8 pairs).
Both paths run on the same weights (the loop first, then `pack_experts`).
Host syncs: the lines where the step made the host wait for the GPU (`torch.cuda`'s sync debug
mode), of `run_local_experts` alone (the dispatcher's own reads are not in it). Needs CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from benchmarks.gpu_rank import fill_random_experts, host_syncs, time_ms
from engine import envs
from engine.distributed.dispatch import ExpertPlacement, RecvBatch, plan_send
from engine.distributed.dispatch.all_to_all import AllToAllDispatcher
from engine.models.deepseek_v41.config import DeepseekV41Config
from engine.models.deepseek_v41.moe import MoE

EP_SIZE = 8


def rank_moe(cfg: DeepseekV41Config, device: torch.device) -> MoE:
    placement = ExpertPlacement(cfg.n_routed_experts, EP_SIZE, 0)
    with torch.device("meta"):
        moe = MoE(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            cfg.routed_scaling_factor,
            cfg.swiglu_limit,
            torch.bfloat16,
            quantized_experts=True,
            dispatcher=AllToAllDispatcher(placement, None),  # only its placement is used
        )
    moe = moe.to_empty(device=device)
    fill_random_experts(moe, torch.Generator(device=device).manual_seed(0))
    return moe.eval()


def received(cfg: DeepseekV41Config, tokens_per_rank: int, device: torch.device) -> RecvBatch:
    """The batch rank 0 receives when every rank routes `tokens_per_rank` tokens at random."""
    generator = torch.Generator(device=device).manual_seed(tokens_per_rank)
    num_tokens, k = EP_SIZE * tokens_per_rank, cfg.num_experts_per_tok
    scores = torch.rand(num_tokens, cfg.n_routed_experts, generator=generator, device=device)
    ids = scores.topk(k, dim=1).indices
    placement = ExpertPlacement(cfg.n_routed_experts, EP_SIZE, 0)
    mine = placement.owner_of(ids) == 0
    rows = mine.any(1).nonzero(as_tuple=True)[0]
    local = torch.where(mine[rows], ids[rows], torch.full_like(ids[rows], -1))
    x = torch.randn(len(rows), cfg.hidden_size, generator=generator, device=device).bfloat16()
    weights = torch.rand(len(rows), k, generator=generator, device=device)
    return RecvBatch(
        x=x,
        local_ids=local,
        weights=weights,
        recv_counts=torch.tensor([len(rows)] + [0] * (EP_SIZE - 1), device=device),
        plan=plan_send(ids[:0], placement),
    )


def measure(moe: MoE, batches: dict[str, RecvBatch], repeats: int) -> dict[str, dict]:
    device = next(moe.buffers()).device
    out = {}
    for name, recv in batches.items():

        def step(recv=recv) -> None:
            moe.run_local_experts(dataclasses.replace(recv))  # fresh: `pairs` not cached

        out[name] = {
            "us": 1e3 * time_ms(step, device, warmup=3, repeats=repeats),
            "host_syncs": host_syncs(step),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", type=int, nargs="*", default=[16, 64, 256])
    parser.add_argument("--prefill", type=int, nargs="*", default=[4096])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=envs.benchmark_out_dir())
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA (the grouped kernel)")
    device = torch.device("cuda")
    cfg = DeepseekV41Config()
    moe = rank_moe(cfg, device)
    sizes = [(f"decode {t}", t) for t in args.decode] + [(f"prefill {t}", t) for t in args.prefill]
    batches = {name: received(cfg, t, device) for name, t in sizes}
    loop = measure(moe, batches, args.repeats)
    moe.pack_experts()
    grouped = measure(moe, batches, args.repeats)
    print(f"{'tokens/rank':>14} {'rows':>6} {'pairs':>6} {'loop µs':>10} {'grouped µs':>11}  syncs")
    result = []
    for name, recv in batches.items():
        pairs = int((recv.local_ids >= 0).sum())
        old, new = loop[name], grouped[name]
        print(
            f"{name:>14} {recv.x.shape[0]:>6} {pairs:>6} {old['us']:>10.0f} {new['us']:>11.0f}"
            f"  loop {old['host_syncs']} | grouped {new['host_syncs']}"
        )
        result.append({"case": name, "rows": recv.x.shape[0], "pairs": pairs,
                       "loop": old, "grouped": new})  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ep_local_experts.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
