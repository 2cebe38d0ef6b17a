"""Each Triton kernel against the torch path it replaces, at the EP8 rank's real shapes.

    python3 benchmarks/kernel_speed.py [--tokens 16 64 256 4096] [--out DIR]

grouped_mxfp4_gemm: one MoE layer's routed experts (48 experts, top-6, hidden 5120, expert
width 2304, MXFP4), T tokens routed by the layer's own gate on random inputs. "before" is the
per-expert path (`MoE` unpacked: host-read counts, each expert's weights dequantised to bf16 then
`F.linear`); "after" the packed MoE (two grouped-kernel launches). Reported: median ms (CUDA
synchronised), the weight bytes of the experts that got rows over the time (GB/s), the routed
FLOPs over the time (TFLOP/s), and the two outputs' relative difference.

grouped: the two grouped-GEMM launches of that layer alone (gate/up + SwiGLU, down), timed
with CUDA events (`triton.testing.do_bench`, median); GB/s counts the codes and scales of the
experts that got rows, "% copy" that over a device-to-device copy's bandwidth (bytes read +
written, 2 GiB) measured in the same run; "before" is the tuned kernel of the other regime
(decode tiles for prefill blocks and the reverse) where it applies, else NaN.

mhc_mix: one hyper-connection site's gates and Sinkhorn (4 streams, 20 iterations) for T tokens;
"before" the torch reference (~120 launches), "after" the kernel; GB/s counts logits in and
coefficients out.

rms_norm: T rows of the hidden width (bf16); GB/s counts rows read and written.

rope: T tokens' queries (64 heads x 512, 64 rotated channels, bf16); GB/s counts q read and
written.

mhc_post / mhc_combine: one site's residual update / stream combination (4 streams x 5120,
bf16); GB/s counts the bf16 rows read and written.

sparse_mqa: one ratio-2 attention layer at 8K context: decode steps of 16 / 64 / 256 sequences
(T = S, window in the MXFP8 ring) and a 4,096-token prefill chunk (window from bf16 rows);
"before" the torch reference (gather + decode [T, 640, 512] fp32 rows, direct softmax; for the
chunk, 256 tokens' time scaled to 4,096), "after" the kernel with its `TILES` choice; GB/s counts
the rows read, q in and the fp32 output. Then every launch shape of `attention_candidates`
(`kernels.sparse_mqa.CANDIDATES`; row splits only for decode) at the same shapes, compiled in
parallel first: µs, GB/s, TFLOP/s (the three bf16 dots: QK, PV head and remainder), the error
against the reference, the fastest per shape, and the `TILES` table the fastest make.

fp8_gemm: the released model's FP8 dense GEMMs (`kernels.fp8_block_gemm`, `--dense-gemm fp8`) at
M = T tokens: attention wq_a, wkv, wq_b, wo_a (8 groups), wo_b, the indexer's wq_b, the shared
expert's w1 (= w3) and w2. "before" is torch.matmul on the bf16-dequantised weight (the default
path; torch.bmm for wo_a's groups), "after" the FP8 kernel quantizing x inside its K loop (one
launch), "after (codes)" `quantize_activations` + the kernel on codes. Timed with CUDA events
(`triton.testing.do_bench`, median); printed in µs and TFLOP/s (2·M·N·K over the time); GB/s
counts the weight bytes (FP8 + scales) plus x in and y out.

fp8_tiles: for the same shapes and T, every tile shape of a small candidate list
(`fp8_tile_candidates`) against `default_config`'s; prints the fastest per shape (what to put
into `default_config` once measured). Writes kernel_speed.json.

index_scores: one indexer's scores (heads x 128, FP4 index keys of a paged pool) at three
layers: 64 heads at ratio 2 and 4K context (J = 2,048 compressed positions, the first layer
timed), the released model's 32 heads at ratio 2 and 1 and 8K context (J = 4,096 and 8,192,
what `gpu_rank` runs), for decode steps of S sequences and a 1,024-token prefill chunk;
"before" the torch path of `Attention._select` (gather the rows, decode them to fp32, bf16 bmm
+ fp32 head sum, mask), "after" `kernels.index_scores` (one launch); GB/s counts the key rows,
queries and head weights read and the fp32 scores written. Also prints µs.

alignment: `kernels.expert_alignment` (one launch) against its torch reference at T tokens of
one rank's routing (48 experts, top-6, skewed as a gate routes: a quarter of the experts take
most pairs), at the block size `_block_m` picks (16 and 32 for decode, 128 for a 4,096-token
chunk) and, for prefill-sized routings, also 64 (the other prefill block). Timed with CUDA
events (`triton.testing.do_bench`, median, µs); both outputs must equal the reference's
(rel_diff 0, else inf); GB/s counts the ids read and the two outputs written. Both are timed
eagerly: the reference's ~20 small launches and the kernel's Triton launch (~7 µs of host time)
bound them at decode sizes; a CUDA graph's replay of the kernel is shorter.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.testing

from benchmarks.gpu_rank import RANK_EXPERTS, fill_random_experts, time_ms
from engine import envs
from engine.models.deepseek_v41.kv_formats import (
    global_fp4_quantize,
    swa_mxfp8_dequantize,
    swa_mxfp8_quantize,
)
from engine.models.deepseek_v41.moe import MoE, _block_m
from engine.models.deepseek_v41.primitives import rope_frequencies
from engine.models.deepseek_v41.weight_formats import fp8_block_dequantize, fp8_block_quantize
from kernels import expert_alignment
from kernels.fp8_block_gemm import (
    GemmConfig,
    default_config,
    fp8_block_gemm,
    fp8_block_gemm_reference,
    quantize_activations,
)
from kernels.grouped_mxfp4_gemm import (
    DECODE_MAX_BLOCK_M,
    align_to_experts,
    decode_tiles,
    grouped_mxfp4_gemm,
    grouped_mxfp4_gemm_reference,
    prefill_tiles,
)
from kernels.mhc_combine import mhc_combine, mhc_combine_reference
from kernels.mhc_mix import mhc_mix, mhc_mix_reference
from kernels.mhc_post import mhc_post, mhc_post_reference
from kernels.rms_norm import rms_norm, rms_norm_reference
from kernels.rope import apply_rope, apply_rope_reference
from kernels.sparse_mqa import (
    CANDIDATES,
    TILES,
    MqaTiles,
    choose_tiles,
    sparse_mqa,
    sparse_mqa_reference,
)

HIDDEN = 5120
EXPERT_WIDTH = 2304
TOP_K = 6
SWIGLU_LIMIT = 10.0


def quantized_moe(device: torch.device) -> MoE:
    with torch.device("meta"):
        moe = MoE(
            HIDDEN, EXPERT_WIDTH, RANK_EXPERTS, TOP_K, 2.5, SWIGLU_LIMIT, torch.bfloat16, True
        )
    moe = moe.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    fill_random_experts(moe, generator)
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.normal_(0.0, HIDDEN**-0.5, generator=generator)
    return moe


def routed_bytes(moe: MoE, x: torch.Tensor) -> float:
    """Expert weight bytes one step reads: codes and scales of each expert with rows."""
    ids, _ = moe.route(x)
    used = int(torch.unique(ids).numel())
    per_expert = 3 * HIDDEN * EXPERT_WIDTH * (0.5 + 1 / 32)
    return used * per_expert


def _row(kernel: str, tokens: int, before: float, after: float, moved: float, flops: float,
         error: float) -> dict:  # fmt: skip
    row = {
        "kernel": kernel,
        "tokens": tokens,
        "before_ms": before,
        "after_ms": after,
        "before_gbs": moved / before / 1e6,
        "after_gbs": moved / after / 1e6,
        "after_tflops": flops / after / 1e9,
        "rel_diff": error,
    }
    print(json.dumps(row), flush=True)
    return row


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.float() - reference.float()).norm() / reference.float().norm())


def moe_rows(tokens: list[int], device: torch.device) -> list[dict]:
    unpacked = quantized_moe(device)
    packed = quantized_moe(device)
    packed.pack_experts()
    rows = []
    for num_tokens in tokens:
        x = torch.randn(num_tokens, HIDDEN, device=device, dtype=torch.bfloat16)
        with torch.inference_mode():
            before = time_ms(lambda x=x: unpacked(x), device, 2, 5)
            after = time_ms(lambda x=x: packed(x), device, 3, 20)
            error = _relative(packed(x), unpacked(x))
            moved = routed_bytes(packed, x)
        flops = 2 * num_tokens * TOP_K * 3 * HIDDEN * EXPERT_WIDTH
        name = "grouped_mxfp4_gemm (MoE layer)"
        rows.append(_row(name, num_tokens, before, after, moved, flops, error))
    return rows


def copy_gbs(device: torch.device) -> float:
    """Device-to-device copy bandwidth, bytes read + written, GB/s."""
    src = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


def grouped_rows(tokens: list[int], device: torch.device) -> list[dict]:
    """The routed experts' two grouped-GEMM launches alone, against the copy bandwidth."""
    copy = copy_gbs(device)
    print(f"copy bandwidth: {copy:.0f} GB/s (read + write)", flush=True)
    moe = quantized_moe(device)
    moe.pack_experts()
    rows = []
    for num_tokens in tokens:
        x = torch.randn(num_tokens, HIDDEN, device=device, dtype=torch.bfloat16)
        with torch.inference_mode():
            ids, weights = moe.route(x)
            blocks = align_to_experts(ids, RANK_EXPERTS, _block_m(ids.numel(), RANK_EXPERTS))
            pair_weight = weights.flatten().float().contiguous()
            used = int(torch.unique(ids).numel())
            gate_up = {"gate_limit": SWIGLU_LIMIT}
            act = grouped_mxfp4_gemm(x, blocks, moe.w13_codes, moe.w13_scales, **gate_up)
            down = {"row_weight": pair_weight, "out_dtype": torch.float32}
            cases = (
                ("gate/up", x, moe.w13_codes, moe.w13_scales, gate_up),
                ("down", act, moe.w2_codes, moe.w2_scales, down),
            )
            for use, inp, codes, scales, kwargs in cases:

                def launch(inp=inp, codes=codes, scales=scales, kwargs=kwargs, blocks=blocks):
                    return grouped_mxfp4_gemm(inp, blocks, codes, scales, **kwargs)

                out = launch()
                reference = grouped_mxfp4_gemm_reference(inp, blocks, codes, scales, **kwargs)
                is_row = blocks.pair_of_pos >= 0
                if use == "gate/up":
                    out, reference = out[is_row], reference[is_row]
                ms = triton.testing.do_bench(launch, warmup=25, rep=100, return_mode="median")
                n_weight, half_k = codes.shape[1], codes.shape[2]
                moved = used * n_weight * half_k * (1 + 1 / 16)
                flops = 2 * num_tokens * TOP_K * n_weight * half_k * 2
                row = _row(f"grouped_mxfp4_gemm {use}", num_tokens, float("nan"), ms, moved,
                           flops, _relative(out, reference))  # fmt: skip
                row["pct_copy"] = 100 * row["after_gbs"] / copy
                choose = decode_tiles if blocks.block_m <= DECODE_MAX_BLOCK_M else prefill_tiles
                tiles = choose(codes.shape[1], 2 * codes.shape[2], blocks.block_m, use == "gate/up")
                row["tiles"] = str(tiles)
                print(f"grouped {use} tiles at {num_tokens} tokens: {tiles}", flush=True)
                row["block_m"] = blocks.block_m
                row["copy_gbs"] = copy
                rows.append(row)
    return rows


def mhc_rows(tokens: list[int], device: torch.device) -> list[dict]:
    """One hyper-connection site's mixing (N = 4 streams, 20 Sinkhorn iterations)."""
    n, eps, iters = 4, 1e-6, 20
    rows = []
    for num_tokens in tokens:
        logits = torch.randn(num_tokens, 2 * n + n * n, device=device) * 3
        before = time_ms(lambda x=logits: mhc_mix_reference(x, n, eps, iters), device, 3, 20)
        after = time_ms(lambda x=logits: mhc_mix(x, n, eps, iters), device, 3, 20)
        comb = mhc_mix(logits, n, eps, iters)[2]
        reference = mhc_mix_reference(logits, n, eps, iters)[2]
        moved = logits.numel() * 4 * 2  # logits in, as many values out
        rows.append(_row("mhc_mix (one mHC site)", num_tokens, before, after, moved, 0.0,
                         _relative(comb, reference)))  # fmt: skip
    return rows


def mhc_update_rows(tokens: list[int], device: torch.device) -> list[dict]:
    """One mHC site's residual update and stream combination (4 streams x 5120, bf16)."""
    n, dim = 4, HIDDEN
    rows = []
    for num_tokens in tokens:
        residual = torch.randn(num_tokens, n, dim, device=device).bfloat16()
        y = torch.randn(num_tokens, dim, device=device).bfloat16()
        post = torch.rand(num_tokens, n, device=device)
        comb = torch.rand(num_tokens, n, n, device=device)
        weights = torch.rand(num_tokens, n, device=device)
        cases = (
            ("mhc_post (one mHC site)", mhc_post, mhc_post_reference, (residual, post, comb, y),
             num_tokens * dim * 2 * (2 * n + 1)),
            ("mhc_combine (one mHC site)", mhc_combine, mhc_combine_reference, (residual, weights),
             num_tokens * dim * 2 * (n + 1)),
        )  # fmt: skip
        for name, kernel, reference, args, moved in cases:
            before = time_ms(lambda r=reference, a=args: r(*a), device, 3, 20)
            after = time_ms(lambda k=kernel, a=args: k(*a), device, 3, 20)
            error = _relative(kernel(*args), reference(*args))
            rows.append(_row(name, num_tokens, before, after, moved, 0.0, error))
    return rows


def rope_rows(tokens: list[int], device: torch.device) -> list[dict]:
    """RoPE of T tokens' queries (64 heads x 512, the last 64 channels rotated, bf16)."""
    freqs = rope_frequencies(64, 10000.0, None).to(device)
    rows = []
    for num_tokens in tokens:
        q = torch.randn(num_tokens, 64, 512, device=device).bfloat16()
        positions = torch.randint(0, 65536, (num_tokens,), device=device)
        args = (q, positions, freqs)
        before = time_ms(lambda a=args: apply_rope_reference(*a), device, 3, 20)
        after = time_ms(lambda a=args: apply_rope(*a), device, 3, 20)
        error = _relative(apply_rope(*args), apply_rope_reference(*args))
        moved = q.numel() * 2 * 2
        rows.append(_row("rope (queries)", num_tokens, before, after, moved, 0.0, error))
    return rows


def rms_norm_rows(tokens: list[int], device: torch.device) -> list[dict]:
    """RMSNorm of T rows of the hidden width (bf16, weighted)."""
    rows = []
    for num_tokens in tokens:
        x = torch.randn(num_tokens, HIDDEN, device=device).bfloat16()
        weight = torch.randn(HIDDEN, device=device).bfloat16()
        before = time_ms(lambda x=x, w=weight: rms_norm_reference(x, w, 1e-20), device, 3, 20)
        after = time_ms(lambda x=x, w=weight: rms_norm(x, w, 1e-20), device, 3, 20)
        error = _relative(rms_norm(x, weight, 1e-20), rms_norm_reference(x, weight, 1e-20))
        moved = num_tokens * HIDDEN * 2 * 2
        rows.append(_row("rms_norm (hidden width)", num_tokens, before, after, moved, 0.0, error))
    return rows


ATTENTION_HEADS, ATTENTION_DIM, ATTENTION_WINDOW, ATTENTION_RATIO = 64, 512, 128, 2
ATTENTION_SELECTED, ATTENTION_CONTEXT = 512, 8192
# (sequences, new tokens each) timed by the attention group: decode steps, one prefill chunk.
ATTENTION_SHAPES = [(16, 1), (64, 1), (256, 1), (1, 4096)]


def attention_inputs(num_seqs: int, new: int, device: torch.device) -> tuple[tuple, dict]:
    """(args, sources) of `sparse_mqa` for one ratio-2 CSA2 layer at 8K context: S decode
    tokens (window in the MXFP8 ring) or one chunk of `new` tokens (window from bf16 rows)."""
    heads, dim, window, ring_len = ATTENTION_HEADS, ATTENTION_DIM, ATTENTION_WINDOW, 134
    ratio, selected, context = ATTENTION_RATIO, ATTENTION_SELECTED, ATTENTION_CONTEXT
    per_block, blocks_per_seq = 128 // ratio, context // 128
    generator = torch.Generator(device=device).manual_seed(num_seqs)
    num_tokens = num_seqs * new
    q = torch.randn(num_tokens, heads, dim, device=device, generator=generator).bfloat16()
    seq_of_token = torch.arange(num_seqs, device=device).repeat_interleave(new)
    positions = context - new + torch.arange(new, device=device).repeat(num_seqs)
    if new == 1:
        ring = swa_mxfp8_quantize(torch.randn(num_seqs, ring_len, dim, device=device))
        sources = {"ring": (ring, torch.arange(num_seqs, device=device))}
    else:
        window_rows = torch.randn(num_seqs, window - 1 + new, dim, device=device)
        window_rows = swa_mxfp8_dequantize(swa_mxfp8_quantize(window_rows)).bfloat16()
        first = torch.arange(new, device=device).repeat(num_seqs)
        sources = {"window_rows": (window_rows, first)}
    pool = global_fp4_quantize(
        torch.randn(num_seqs * blocks_per_seq, per_block, dim, device=device)
    )
    tables = torch.arange(num_seqs * blocks_per_seq, device=device).view(num_seqs, -1)
    selection = torch.randint(0, context // ratio, (num_tokens, selected), device=device)
    sources["global_rows"] = (pool, selection, tables, ratio)
    args = (q, seq_of_token, positions, torch.randn(heads, device=device), window, dim**-0.5)
    return args, sources


def _attention_traffic(num_seqs: int, new: int) -> tuple[float, float]:
    """(bytes read and written, FLOPs of the dots as the kernel runs them) of one launch:
    QK one bf16 dot, PV two (the probabilities' head and remainder)."""
    heads, dim, window = ATTENTION_HEADS, ATTENTION_DIM, ATTENTION_WINDOW
    num_tokens = num_seqs * new
    if new == 1:
        moved = num_seqs * window * (dim + dim // 32)
    else:
        moved = num_seqs * (window - 1 + new) * dim * 2
    moved += num_tokens * ATTENTION_SELECTED * (dim // 2 + dim // 16)
    moved += num_tokens * heads * dim * (2 + 4)  # q in, fp32 out
    flops = 2 * 3 * num_tokens * heads * dim * (window + ATTENTION_SELECTED)
    return moved, flops


def _slice_tokens(args: tuple, sources: dict, count: int) -> tuple[tuple, dict]:
    """The first `count` query tokens of a launch (the reference of a 4,096-token chunk would
    materialise 5 GB of rows; tokens are independent)."""
    q, seq_of_token, positions, *rest = args
    sliced = {}
    for key, value in sources.items():
        if key == "window_rows":
            sliced[key] = (value[0], value[1][:count])
        elif key == "global_rows":
            sliced[key] = (value[0], value[1][:count], *value[2:])
        else:
            sliced[key] = value
    return (q[:count], seq_of_token[:count], positions[:count], *rest), sliced


def attention_rows(device: torch.device) -> list[dict]:
    """One ratio-2 CSA2 layer (64 heads x 512, window 128, 512 selected rows of a paged FP4 pool
    at 8K context): torch reference vs `sparse_mqa` with its chosen tiles (`TILES`), for decode
    steps of S sequences (window in the MXFP8 ring) and a 4,096-token prefill chunk (window
    from bf16 rows; the reference on its first 256 tokens)."""
    rows = []
    for num_seqs, new in ATTENTION_SHAPES:
        args, sources = attention_inputs(num_seqs, new, device)
        checked = _slice_tokens(args, sources, 256)
        before = time_ms(lambda a=checked, s=sources: sparse_mqa_reference(*a[0], **a[1]),
                         device, 2, 10)  # fmt: skip
        after = time_ms(lambda a=args, s=sources: sparse_mqa(*a, **s), device, 3, 20)
        ours = sparse_mqa(*checked[0], **checked[1])
        error = _relative(ours, sparse_mqa_reference(*checked[0], **checked[1]))
        moved, flops = _attention_traffic(num_seqs, new)
        if new > 256:  # "before" ran 256 of the tokens
            before *= new / 256
        phase = "decode" if new == 1 else "prefill"
        name = f"sparse_mqa ({phase}, one layer)"
        rows.append(_row(name, num_seqs * new, before, after, moved, flops, error))
        print(
            f"{name} tiles at {num_seqs * new} tokens: {choose_tiles(num_seqs * new)}", flush=True
        )
    return rows


def attention_candidates(new: int) -> list[MqaTiles]:
    """The launch shapes timed for a shape: every candidate for decode; for prefill chunks
    (tokens enough to fill the GPU) those without row splits."""
    shapes = {*CANDIDATES, *(tiles for _, tiles in TILES)}
    if new > 1:
        shapes = {tiles for tiles in shapes if tiles.splits == 1}
    return sorted(shapes, key=str)


def _warm_attention(job: tuple[int, int, MqaTiles, str]) -> str:
    """Compile one (shape, tiles) in a worker process (the Triton cache is on disk)."""
    num_seqs, new, tiles, device = job
    args, sources = attention_inputs(min(num_seqs, 16), min(new, 256), device)
    try:
        sparse_mqa(*args, **sources, tiles=tiles)
    except Exception as error:  # noqa: BLE001 - reported by the timing pass in the parent
        return f"{tiles}: {type(error).__name__}"
    return ""


def _parallel_map(fn, jobs: list) -> list:
    """fn over jobs in spawned processes, at most 16 (compiling is most of the group's time)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(min(len(jobs), 16)) as pool:
        return pool.map(fn, jobs)


def attention_tile_rows(device: torch.device) -> list[dict]:
    """Every `sparse_mqa` launch shape (`attention_candidates`) at the decode and prefill shapes:
    µs, GB/s, TFLOP/s and the error against the reference (on up to 256 tokens); prints the
    fastest per shape and the `TILES` table they make (`kernels/sparse_mqa.py`)."""
    sources = {n > 1: (s, n) for s, n in ATTENTION_SHAPES}.values()  # one ring, one rows
    jobs = [(s, n, t, str(device)) for s, n in sources for t in attention_candidates(n)]
    for failure in filter(None, _parallel_map(_warm_attention, jobs)):
        print(f"sparse_mqa tiles compile: {failure}", flush=True)
    rows, best = [], {}
    for num_seqs, new in ATTENTION_SHAPES:
        num_tokens = num_seqs * new
        args, sources = attention_inputs(num_seqs, new, device)
        checked = _slice_tokens(args, sources, 256)
        reference = sparse_mqa_reference(*checked[0], **checked[1])
        moved, flops = _attention_traffic(num_seqs, new)
        chosen = choose_tiles(num_tokens)
        timed = {}
        for tiles in attention_candidates(new):
            try:
                us = _bench_us(lambda a=args, s=sources, t=tiles: sparse_mqa(*a, **s, tiles=t))
                error = _relative(sparse_mqa(*checked[0], **checked[1], tiles=tiles), reference)
            except Exception as failure:  # noqa: BLE001 - a shape that does not launch here
                print(f"sparse_mqa T={num_tokens:>5} {tiles}: {type(failure).__name__}")
                continue
            timed[tiles] = us
            mark = " <- TILES" if tiles == chosen else ""
            print(
                f"sparse_mqa T={num_tokens:>5} {str(tiles):<22} {us:9.1f} µs "
                f"{moved / us / 1e3:7.0f} GB/s {flops / us / 1e6:6.1f} TFLOP/s "
                f"rel {error:.1e}{mark}",
                flush=True,
            )
            rows.append({
                "kernel": f"sparse_mqa {tiles}", "tokens": num_tokens, "before_ms": float("nan"),
                "after_ms": us / 1e3, "after_gbs": moved / us / 1e3,
                "after_tflops": flops / us / 1e6, "rel_diff": error, "tiles": str(tiles),
            })  # fmt: skip
        best[num_tokens] = min(timed, key=timed.get)
        print(
            f"sparse_mqa T={num_tokens:>5}: TILES {chosen} {timed.get(chosen, float('nan')):.1f} µs"
            f" | fastest {best[num_tokens]} {timed[best[num_tokens]]:.1f} µs",
            flush=True,
        )
    print("sparse_mqa: the fastest as a TILES table (kernels/sparse_mqa.py):")
    bounds = [*best][:-1] + ["1 << 62"]
    for bound, tiles in zip(bounds, best.values(), strict=True):
        print(f"    ({bound}, {tiles!r}),")
    return rows


# (name, N per group, K, groups) of the released model's FP8 dense linears (model.md §5.3).
DENSE_GEMMS = [
    ("attn.wq_a", 1280, 5120, 1),
    ("attn.wkv", 512, 5120, 1),
    ("attn.wq_b", 32768, 1280, 1),
    ("attn.wo_a (8 groups)", 1024, 4096, 8),
    ("attn.wo_b", 5120, 8192, 1),
    ("indexer.wq_b", 4096, 1280, 1),
    ("shared w1 (= w3)", 2304, 5120, 1),
    ("shared w2", 5120, 2304, 1),
]


def _bench_us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def fp8_gemm_rows(tokens: list[int], device: torch.device) -> list[dict]:
    """bf16 torch.matmul vs the FP8 block GEMM at the released model's dense shapes."""
    rows = []
    for name, n, k, groups in DENSE_GEMMS:
        weight, scale = fp8_block_quantize(torch.randn(groups * n, k, device=device) * k**-0.5)
        dense = fp8_block_dequantize(weight, scale, dtype=torch.bfloat16)
        grouped = dense.view(groups, n, k).transpose(1, 2)  # [G, K, N]
        for m in tokens:
            x = torch.randn(m, groups * k, device=device).bfloat16()
            if groups == 1:

                def bf16(x=x, w=dense):
                    return torch.matmul(x, w.t())
            else:

                def bf16(x=x, w=grouped, g=groups):
                    return torch.bmm(x.unflatten(-1, (g, -1)).transpose(0, 1), w).transpose(0, 1)

            def fp8(x=x, w=weight, s=scale, g=groups):
                return fp8_block_gemm(x, w, s, groups=g)

            def fp8_codes(x=x, w=weight, s=scale, g=groups):
                codes, x_scale = quantize_activations(x)
                return fp8_block_gemm(codes, w, s, groups=g, x_scale=x_scale)

            with torch.inference_mode():
                before, after, codes_us = _bench_us(bf16), _bench_us(fp8), _bench_us(fp8_codes)
                reference = fp8_block_gemm_reference(x, weight, scale, groups=groups)
                error = _relative(fp8(), reference)
            flops = 2 * m * groups * n * k
            moved = groups * n * k * (1 + 1 / 1024) + m * groups * (k + n) * 2
            rates = [
                f"{us:9.1f} µs {flops / us / 1e6:7.1f} TFLOP/s" for us in (before, after, codes_us)
            ]
            print(
                f"fp8_gemm {name:<22} M={m:>5}: bf16 {rates[0]} | fp8 {rates[1]} | "
                f"fp8 (codes) {rates[2]} | rel {error:.1e}",
                flush=True,
            )
            for label, us in ((name, after), (f"{name} (codes)", codes_us)):
                row = _row(f"fp8_gemm {label}", m, before / 1e3, us / 1e3, moved, flops, error)
                row["before_tflops"] = flops / before / 1e6
                rows.append(row)
    return rows


def fp8_tile_candidates(m: int) -> list[GemmConfig]:
    """Tile shapes worth timing for M rows: narrow N tiles and K splits for small M (bound by
    the weight bytes), wgmma-sized tiles (≥ 64 rows) for large M."""
    if m <= 16:
        shapes = [(16, 32), (16, 64), (16, 128), (64, 64)]
        return [
            GemmConfig(bm, bn, split, 4, stages)
            for bm, bn in shapes
            for split in (1, 4, 8, 16)
            for stages in (4, 6)
        ]
    if m <= 256:
        shapes = [(64, 64), (64, 128), (128, 128)]
        return [GemmConfig(bm, bn, split, 4, 4) for bm, bn in shapes for split in (1, 2, 4, 8)]
    return [
        GemmConfig(bm, bn, 1, warps, stages)
        for bm, bn, warps in ((128, 128, 8), (128, 256, 8), (64, 256, 4), (128, 64, 4))
        for stages in (3, 4, 5)
    ]


def fp8_tile_rows(tokens: list[int], device: torch.device) -> list[dict]:
    """The fastest candidate tile shape per dense shape and T, against `default_config`."""
    rows = []
    for name, n, k, groups in DENSE_GEMMS:
        weight, scale = fp8_block_quantize(torch.randn(groups * n, k, device=device) * k**-0.5)
        for m in tokens:
            x = torch.randn(m, groups * k, device=device).bfloat16()

            def run(config, x=x, w=weight, s=scale, g=groups):
                return fp8_block_gemm(x, w, s, groups=g, config=config)

            with torch.inference_mode():
                default = default_config(m, n, k)
                timed = {config: _bench_us(lambda c=config: run(c)) for config in
                         {default, *fp8_tile_candidates(m)}}  # fmt: skip
            best = min(timed, key=timed.get)
            flops = 2 * m * groups * n * k
            print(
                f"fp8_tiles {name:<22} M={m:>5}: default {timed[default]:8.1f} µs {default} | "
                f"best {timed[best]:8.1f} µs {flops / timed[best] / 1e6:7.1f} TFLOP/s {best}",
                flush=True,
            )
            row = _row(f"fp8_tiles {name}", m, timed[default] / 1e3, timed[best] / 1e3, 0.0,
                       flops, 0.0)  # fmt: skip
            row["best_config"] = repr(best)
            rows.append(row)
    return rows


def index_score_rows(sequences: list[int], device: torch.device) -> list[dict]:
    """The indexer layers of the `index_scores` group (module docstring)."""
    return [
        row
        for heads, ratio, context in INDEX_LAYERS
        for row in index_layer_rows(heads, ratio, context, sequences, device)
    ]


INDEX_LAYERS = ((64, 2, 4096), (32, 2, 8192), (32, 1, 8192))  # (heads, ratio, context)


def index_layer_rows(
    heads: int, ratio: int, context: int, sequences: list[int], device: torch.device
) -> list[dict]:
    from engine.models.deepseek_v41.attention import Attention
    from engine.models.deepseek_v41.kv_formats import index_fp4_quantize, index_fp4_round_trip
    from kernels.fp4_rows import index_fp4_rows_dequantize
    from kernels.index_scores import CANDIDATES, choose_tiles, index_scores

    dim, num_j = 128, context // ratio
    per_block, blocks_per_seq = 128 // ratio, context // 128
    rows = []
    for num_seqs, new in [(s, 1) for s in sequences] + [(1, 1024)]:
        generator = torch.Generator(device=device).manual_seed(num_seqs)
        num_tokens = num_seqs * new

        def randn(*shape, g=generator):
            return torch.randn(*shape, device=device, generator=g)

        pool = index_fp4_quantize(randn(num_seqs * blocks_per_seq, per_block, dim))
        tables = torch.randperm(num_seqs * blocks_per_seq, device=device).view(num_seqs, -1)
        iq = index_fp4_round_trip(randn(num_tokens, heads, dim))
        hw = randn(num_tokens, heads) * (dim**-0.5 * heads**-0.5)
        positions = context - new + torch.arange(new, device=device).repeat(num_seqs)
        pad_index = torch.arange(num_tokens, device=device).view(num_seqs, new)
        args = (iq, hw, pool, tables, ratio, pad_index, positions, num_j)
        j = torch.arange(num_j, device=device)
        block = tables[:, (j * ratio) // 128]
        row = (j % per_block)[None, :].expand_as(block)
        visible = torch.div(positions.view(num_seqs, new) + 1, ratio, rounding_mode="floor")
        hidden = j[None, None, :] >= visible[..., None]

        def before(a=args, block=block, row=row, hidden=hidden):
            keys = index_fp4_rows_dequantize(a[2][block, row])
            q, w = a[0].view(*a[5].shape, heads, dim), a[1].view(*a[5].shape, heads)
            scores = Attention._index_scores(q, w, keys, keys.is_cuda)
            return scores.masked_fill(hidden, float("-inf"))

        before_us = _bench_us(before)
        after_us = _bench_us(lambda a=args: index_scores(*a))
        candidates_us = {
            str(tiles): _bench_us(lambda a=args, t=tiles: index_scores(*a, tiles=t))
            for tiles in CANDIDATES
        }
        ours, theirs = index_scores(*args), before()
        finite = torch.isfinite(theirs)
        same_inf = bool(torch.equal(finite, torch.isfinite(ours)))
        error = _relative(ours[finite], theirs[finite]) if same_inf else float("inf")
        moved = num_seqs * num_j * (dim // 2 + dim // 32) + num_tokens * heads * (dim + 1) * 4
        moved += num_tokens * num_j * 4
        flops = 2 * num_tokens * heads * num_j * dim
        phase = "decode" if new == 1 else "prefill"
        name = f"index_scores h{heads} J{num_j} ({phase})"
        rows.append(_row(name, num_tokens, before_us / 1e3, after_us / 1e3, moved, flops, error))
        print(
            f"{name} S={num_seqs} T={num_tokens}: before {before_us:.1f} µs "
            f"({moved / before_us / 1e3:.0f} GB/s), after {after_us:.1f} µs "
            f"({moved / after_us / 1e3:.0f} GB/s) with TILES {choose_tiles(new)}; candidates µs "
            + ", ".join(f"{name} {us:.1f}" for name, us in candidates_us.items()),
            flush=True,
        )
    return rows


def alignment_rows(tokens: list[int], device: torch.device) -> list[dict]:
    """The expert alignment of T tokens' routing, kernel against reference (module docstring)."""
    kernel = expert_alignment.align_to_experts
    reference = expert_alignment.align_to_experts_reference
    rows = []
    for num_tokens in tokens:
        generator = torch.Generator(device=device).manual_seed(num_tokens)
        scores = torch.rand(num_tokens, RANK_EXPERTS, device=device, generator=generator) ** 4
        scores[:, : RANK_EXPERTS // 4] += 0.5
        ids = torch.topk(scores, TOP_K, dim=-1).indices  # int64, as the router's
        num_pairs = ids.numel()
        if num_pairs > expert_alignment.MAX_PAIRS:
            print(f"alignment T={num_tokens}: {num_pairs} pairs, over MAX_PAIRS", flush=True)
            continue
        block_m = _block_m(num_pairs, RANK_EXPERTS)
        for block in sorted({block_m, 64} if block_m > DECODE_MAX_BLOCK_M else {block_m}):
            args = (ids, RANK_EXPERTS, block)
            before = _bench_us(lambda a=args: reference(*a))
            after = _bench_us(lambda a=args: kernel(*a))
            ours = kernel(*args)
            same = all(torch.equal(a, b) for a, b in zip(ours, reference(*args), strict=True))
            moved = num_pairs * ids.element_size() + sum(t.numel() * 4 for t in ours)
            print(
                f"alignment T={num_tokens:>5} pairs={num_pairs:>6} block_m={block:>3}: "
                f"reference {before:8.1f} µs | kernel {after:6.1f} µs | "
                f"{'equal' if same else 'DIFFERENT'}",
                flush=True,
            )
            error = 0.0 if same else float("inf")
            name = f"expert_alignment block {block}"
            rows.append(_row(name, num_tokens, before / 1e3, after / 1e3, moved, 0.0, error))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[16, 64, 256, 4096])
    parser.add_argument("--out", type=Path, default=envs.benchmark_out_dir())
    groups = {
        "moe": moe_rows,
        "grouped": grouped_rows,
        "mhc_mix": mhc_rows,
        "mhc_update": mhc_update_rows,
        "rms_norm": rms_norm_rows,
        "rope": rope_rows,
        "attention": lambda _tokens, device: attention_tile_rows(device) + attention_rows(device),
        "fp8_gemm": fp8_gemm_rows,
        "fp8_tiles": fp8_tile_rows,
        "index_scores": lambda _tokens, device: index_score_rows([16, 64, 256], device),
        "alignment": alignment_rows,
    }
    parser.add_argument("--only", nargs="*", choices=sorted(groups), default=sorted(groups))
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = [
        row for name in groups if name in args.only for row in groups[name](args.tokens, device)
    ]
    print(
        f"\n{'kernel':<32} {'T':>5} {'before ms':>10} {'after ms':>9} {'GB/s':>7} "
        f"{'TFLOP/s':>8} {'rel diff':>9} {'% copy':>7}"
    )
    for row in rows:
        print(
            f"{row['kernel']:<32} {row['tokens']:>5} {row['before_ms']:>10.3f} "
            f"{row['after_ms']:>9.3f} {row['after_gbs']:>7.0f} {row['after_tflops']:>8.1f} "
            f"{row['rel_diff']:>9.2e} {row.get('pct_copy', float('nan')):>7.1f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_speed.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
