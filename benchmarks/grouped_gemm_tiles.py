"""Tile sweep of the grouped MXFP4 GEMM at one EP8 rank's MoE shapes (48 experts, top-6, hidden
5120, expert width 2304): each (tokens, use, tiles) timed alone, against the copy bandwidth.

    python3 benchmarks/grouped_gemm_tiles.py [--tokens 16 64 256 4096] [--baseline MODULE]
        [--decode-rows 64] [--prefetch-tiles] [--split-gate-up] [--register-unpack] [--gluon]

`--decode-rows BM`: blocks of BM rows also run through the decode kernel (the launcher gives
blocks above `DECODE_MAX_BLOCK_M` rows to the prefill kernel), with its table's tiles under
several register caps, with and without the prefetch.

`--prefetch-tiles`: decode blocks run the register-prefetch kernel at each of the kernel's
`DECODE_CANDIDATES` (weight rows per program, register cap) instead of the old explicit list.

`--register-unpack`: prefill blocks (more than 32 rows) also run the prefill kernel with the
decode kernel's in-register unpack at each of `REGISTER_PREFILL_CANDIDATES` (BLOCK_K 128).

`--gluon`: decode blocks also run the Gluon decode kernel (`kernels.grouped_mxfp4_gluon`) at
each of its `CANDIDATES` (warps, ring slots), and blocks of 128 rows (prefill, `--tokens 4096`)
at its `PREFILL_CANDIDATES`, x reordered into the kernel's K order inside the timed call as the
Triton kernel's launcher does; also the warp-specialized TMA kernel (`kernels.grouped_mxfp4_ws`)
at its `DECODE_CANDIDATES` (blocks of up to 64) or `PREFILL_CANDIDATES` (128), the gate/up's x
gathered into position order inside the timed call.

`--split-gate-up`: instead of the sweep, gate/up as the table runs it (one fused launch per
block size) against the split candidate at blocks of 32 and 64 rows: one ungated decode-kernel
launch over the 4,608 packed [W1; W3] rows with token input rows (`_launch_decode(...,
token_rows=True)`: one accumulator, so 64-row blocks fit the registers and each expert's
weights are unpacked once), bf16 [gate | up] rows written, then `clamped_swiglu`; both launches
timed together; the error is against the fused reference.

GB/s counts the codes and scales of the experts that got rows (each read once); "% copy" is that
over a device-to-device copy's bandwidth (bytes read + written) measured in the same run.
"""

from __future__ import annotations

import argparse
import importlib

import torch
import triton
import triton.testing

from kernels import grouped_mxfp4_gemm as grouped
from kernels import grouped_mxfp4_gluon as gluon_decode
from kernels import grouped_mxfp4_ws

EXPERTS, HIDDEN, WIDTH, TOP_K, LIMIT = 48, 5120, 2304, 6, 10.0
DECODE_TILES = [(64, 4, 3), (64, 4, 3, 128), (64, 4, 4, 128), (64, 4, 2, 128), (64, 4, 3, 96),
                (128, 4, 3), (128, 4, 3, 168), (128, 8, 3, 128)]  # fmt: skip
# The prefill kernel's former autotuner candidates (BLOCK_N, BLOCK_K, warps, stages).
PREFILL_TILES = [(32, 32, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3), (32, 256, 4, 3),
                 (64, 256, 8, 3), (128, 64, 4, 4), (64, 64, 4, 4)]  # fmt: skip


def copy_gbs() -> float:
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * 2 / ms / 1e6


def block_m_of(num_tokens: int) -> list[int]:
    per_expert = num_tokens * TOP_K / EXPERTS
    if per_expert <= 16:
        return [16]
    if per_expert <= 32:
        return [32, 16]
    return [64, 128] if per_expert > 128 else [64]


def weights(generator: torch.Generator):
    def codes(*shape):
        return torch.randint(-128, 128, shape, generator=generator, device="cuda", dtype=torch.int8)

    def scales(*shape):
        return torch.randint(118, 124, shape, generator=generator, device="cuda", dtype=torch.uint8)

    return {
        "gate_up": (
            codes(EXPERTS, 2 * WIDTH, HIDDEN // 2),
            scales(EXPERTS, 2 * WIDTH, HIDDEN // 32),
        ),
        "down": (codes(EXPERTS, HIDDEN, WIDTH // 2), scales(EXPERTS, HIDDEN, WIDTH // 32)),
    }


def forced_decode_tiles(n_weight: int, k: int, block_m: int, gated: bool) -> list[tuple]:
    """(name, tiles dict) of the decode kernel for blocks the launcher gives to prefill."""
    n = n_weight // 2 if gated else n_weight
    table = grouped.decode_tiles(n, k, block_m, gated)
    out = []
    for prefetch, maxnreg in ((True, 128), (True, 168), (True, 232)):
        tiles = {**table, "PREFETCH": prefetch, "maxnreg": maxnreg}
        out.append((f"decode p{int(prefetch)} r{maxnreg}", tiles))
    if not gated:  # one accumulator: 128 weight rows (two warpgroups) fit without spills
        out.append(("decode n128 r168", grouped._prefetch_tiles(128, 168)))
    return out


def launch_tiles(x, blocks, codes, scales, gated, row_weight, tiles):
    """One launch with explicit tiles (decode: BLOCK_N, warps, stages[, register cap]; prefill:
    BLOCK_N, BLOCK_K, warps, stages), the decode kernel's launch options as a dict (whatever
    the block size), or the launcher's own table (tiles None)."""
    n_weight = codes.shape[1]
    n = n_weight // 2 if gated else n_weight
    out_rows = blocks.num_positions if gated else blocks.num_pairs
    out = torch.empty(out_rows, n, dtype=torch.bfloat16 if gated else torch.float32, device="cuda")
    gate_limit = LIMIT if gated else None
    if isinstance(tiles, dict) and tiles.get("WS"):  # x gathered and reordered in the timed call
        x = grouped.rows_at_positions(x, blocks) if gated else grouped._in_kernel_order(x)
        options = {key: value for key, value in tiles.items() if key != "WS"}
        grouped_mxfp4_ws.launch(x, blocks, (codes, scales), out, gate_limit, row_weight,
                                **options)  # fmt: skip
        return out
    if isinstance(tiles, dict) and tiles.get("GLUON"):
        options = {key: value for key, value in tiles.items() if key != "GLUON"}
        gluon_decode.launch_decode(grouped._in_kernel_order(x), blocks, (codes, scales), out,
                                   gate_limit, row_weight, **options)  # fmt: skip
        return out
    if isinstance(tiles, dict):
        launch = grouped._launch_prefill if tiles.get("REGISTER_UNPACK") else grouped._launch_decode
        launch(x, blocks, (codes, scales), out, gate_limit, row_weight, **tiles)
        return out
    if tiles is None:
        return grouped.grouped_mxfp4_gemm(
            x, blocks, codes, scales, gate_limit=gate_limit, row_weight=row_weight,
            out_dtype=out.dtype,
        )  # fmt: skip
    if blocks.block_m > grouped.DECODE_MAX_BLOCK_M:
        block_n, block_k, warps, stages = tiles
        grouped._launch_prefill(
            x, blocks, (codes, scales), out, gate_limit, row_weight, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out
    block_n, warps, stages, *maxnreg = tiles
    extra = {"maxnreg": maxnreg[0]} if maxnreg else {}
    grouped._launch_decode(
        x, blocks, (codes, scales), out, gate_limit, row_weight, BLOCK_N=block_n,
        PREFETCH=False, num_warps=warps, num_stages=stages, **extra,
    )  # fmt: skip
    return out


def relative(ours, reference, used=None):
    if used is not None:
        ours, reference = ours[used], reference[used]
    return float((ours.float() - reference.float()).norm() / reference.float().norm())


# (weight rows per program, register cap) of the split candidate's ungated launch
SPLIT_TILES = ((64, 168), (128, 168))


def split_gate_up(tokens: list[int], w: dict, generator: torch.Generator, copy: float) -> None:
    """`--split-gate-up` (module docstring): ms per layer's gate/up, fused table vs split."""
    from kernels.clamped_swiglu import clamped_swiglu

    codes, scales = w["gate_up"]
    n_w, half_k = codes.shape[1], codes.shape[2]
    print(f"{'T':>5} {'BM':>4} {'gate/up':<28} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'rel err':>8}")
    for num_tokens in tokens:
        scores = torch.rand(num_tokens, EXPERTS, generator=generator, device="cuda")
        ids = torch.topk(scores, TOP_K, dim=-1).indices
        used = int(torch.unique(ids).numel())
        moved = used * n_w * (half_k + half_k * 2 // 32)
        x = torch.randn(num_tokens, HIDDEN, generator=generator, device="cuda").bfloat16()
        for block_m in (16, 32, 64):
            if block_m < 32 and block_m not in block_m_of(num_tokens):
                continue
            blocks = grouped.align_to_experts(ids, EXPERTS, block_m)
            is_pos = blocks.pair_of_pos >= 0
            reference = grouped.grouped_mxfp4_gemm_reference(
                x, blocks, codes, scales, gate_limit=LIMIT
            )
            candidates = []
            if block_m in block_m_of(num_tokens):

                def fused(blocks=blocks, x=x):
                    return grouped.grouped_mxfp4_gemm(x, blocks, codes, scales, gate_limit=LIMIT)

                candidates.append(("fused (table)", fused))
            for block_n, cap in SPLIT_TILES if block_m >= 32 else ():
                tiles = {**grouped._prefetch_tiles(block_n, cap)}

                def split(blocks=blocks, tiles=tiles, x=x):
                    rows = torch.empty(blocks.num_positions, n_w, dtype=torch.bfloat16,
                                       device="cuda")  # fmt: skip
                    grouped._launch_decode(x, blocks, (codes, scales), rows, None, None,
                                           token_rows=True, **tiles)  # fmt: skip
                    return clamped_swiglu(rows, LIMIT)

                candidates.append((f"split n{block_n} r{cap}", split))
            for name, fn in candidates:
                try:
                    error = relative(fn(), reference, is_pos)
                    ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
                except Exception as exc:  # noqa: BLE001 - a sweep reports and goes on
                    print(f"{num_tokens} {block_m} {name}: FAILED {type(exc).__name__}: "
                          f"{str(exc)[:300]}", flush=True)  # fmt: skip
                    continue
                gbs = moved / ms / 1e6
                print(f"{num_tokens:>5} {block_m:>4} {name:<28} {ms:>8.4f} {gbs:>7.0f} "
                      f"{100 * gbs / copy:>6.1f} {error:>8.1e}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[16, 64, 256, 4096])
    parser.add_argument("--baseline", default=None, help="module with an older launcher")
    parser.add_argument("--no-tuned", action="store_true", help="explicit tiles only")
    parser.add_argument("--tuned-only", action="store_true", help="no explicit tiles")
    parser.add_argument("--decode-rows", type=int, nargs="*", default=[], help="see the docstring")
    parser.add_argument("--prefetch-tiles", action="store_true", help="see the docstring")
    parser.add_argument("--split-gate-up", action="store_true", help="see the docstring")
    parser.add_argument("--register-unpack", action="store_true", help="see the docstring")
    parser.add_argument("--gluon", action="store_true", help="see the docstring")
    parser.add_argument("--block-m", type=int, nargs="*", default=[], help="only these block sizes")
    args = parser.parse_args()
    baseline = importlib.import_module(args.baseline) if args.baseline else None
    copy = copy_gbs()
    print(f"copy bandwidth: {copy:.0f} GB/s (read + write)", flush=True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    w = weights(generator)
    if args.split_gate_up:
        split_gate_up(args.tokens, w, generator, copy)
        return
    rows = []
    for num_tokens in args.tokens:
        scores = torch.rand(num_tokens, EXPERTS, generator=generator, device="cuda")
        ids = torch.topk(scores, TOP_K, dim=-1).indices
        used = int(torch.unique(ids).numel())
        x = torch.randn(num_tokens, HIDDEN, generator=generator, device="cuda").bfloat16()
        pair_weight = torch.rand(num_tokens * TOP_K, generator=generator, device="cuda")
        chosen = args.block_m or {*block_m_of(num_tokens), *args.decode_rows}
        for block_m in sorted(chosen):
            blocks = grouped.align_to_experts(ids, EXPERTS, block_m)
            is_pos = blocks.pair_of_pos >= 0
            codes, scales = w["gate_up"]
            act_ref = grouped.grouped_mxfp4_gemm_reference(
                x, blocks, codes, scales, gate_limit=LIMIT
            )
            act_ref[~is_pos] = 0
            cases = {
                "gate_up": (x, True, None, act_ref),
                "down": (act_ref, False, pair_weight, None),
            }
            for use, (inp, gated, row_weight, ref) in cases.items():
                codes, scales = w[use]
                if ref is None:
                    ref = grouped.grouped_mxfp4_gemm_reference(
                        inp, blocks, codes, scales, row_weight=row_weight, out_dtype=torch.float32
                    )
                n_w, half_k = codes.shape[1], codes.shape[2]
                moved = used * n_w * (half_k + half_k * 2 // 32)
                flops = 2 * num_tokens * TOP_K * n_w * half_k * 2
                forced = block_m in args.decode_rows and block_m > grouped.DECODE_MAX_BLOCK_M
                candidates = [] if args.no_tuned else [("new (table)", None)]
                registered = args.register_unpack and block_m > grouped.DECODE_MAX_BLOCK_M
                if registered:
                    candidates += [
                        (f"register n{t['BLOCK_N']} w{t['num_warps']} s{t['num_stages']}", t)
                        for t in grouped.REGISTER_PREFILL_CANDIDATES
                    ]
                if forced:
                    candidates += forced_decode_tiles(n_w, half_k * 2, block_m, gated)
                elif args.prefetch_tiles and block_m <= grouped.DECODE_MAX_BLOCK_M:
                    candidates += [
                        (f"prefetch n{t['BLOCK_N']} r{t['maxnreg']}", t)
                        for t in grouped.DECODE_CANDIDATES
                    ]
                elif not args.tuned_only and not registered:
                    explicit = (
                        DECODE_TILES if block_m <= grouped.DECODE_MAX_BLOCK_M else PREFILL_TILES
                    )
                    candidates += [("new " + str(t), t) for t in explicit]
                gluon_rows = block_m <= grouped.DECODE_MAX_BLOCK_M or block_m in args.decode_rows
                if args.gluon and (gluon_rows and block_m <= 64 or block_m == 128):
                    tables = gluon_decode.CANDIDATES if block_m <= 64 else ()
                    tables += gluon_decode.PREFILL_CANDIDATES if block_m >= 64 else ()
                    candidates += [
                        (
                            f"gluon w{t['num_warps']} s{t['stages']}"
                            + (" early" if t.get("early_up_words") else "")
                            + (f" g{t['group_blocks']}" if t.get("group_blocks") else "")
                            + (f" r{t['max_registers']}" if t.get("max_registers") else ""),
                            {"GLUON": True, **t},
                        )
                        for t in tables
                    ]
                if args.gluon and (gluon_rows and block_m <= 64 or block_m == 128):
                    ws_tables = (
                        grouped_mxfp4_ws.PREFILL_CANDIDATES
                        if block_m == 128
                        else grouped_mxfp4_ws.DECODE_CANDIDATES
                    )
                    candidates += [
                        (
                            f"ws w{t['num_warps']} s{t['stages']} g{t['group_blocks']} "
                            f"r{t['max_registers']}",
                            {"WS": True, **t},
                        )
                        for t in ws_tables
                    ]
                if baseline is not None:
                    candidates.insert(0, ("baseline (autotuned)", None))
                for name, tiles in candidates:
                    try:
                        if name.startswith("baseline"):
                            kw = (
                                {"gate_limit": LIMIT}
                                if gated
                                else {"row_weight": row_weight, "out_dtype": torch.float32}
                            )

                            def fn(inp=inp, kw=kw, codes=codes, scales=scales, blocks=blocks):
                                return baseline.grouped_mxfp4_gemm(
                                    inp, baseline.ExpertBlocks(**vars(blocks)), codes, scales, **kw
                                )
                        else:

                            def fn(inp=inp, codes=codes, scales=scales, gated=gated,
                                   row_weight=row_weight, tiles=tiles, blocks=blocks):  # fmt: skip
                                return launch_tiles(inp, blocks, codes, scales, gated, row_weight,
                                                    tiles)  # fmt: skip

                        out = fn()
                        error = relative(out, ref, is_pos if gated else None)
                        ms = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
                    except Exception as exc:  # noqa: BLE001 - a sweep reports and goes on
                        print(f"{num_tokens} {use} {name}: FAILED {type(exc).__name__}: "
                              f"{str(exc)[:300]}", flush=True)  # fmt: skip
                        continue
                    row = (num_tokens, block_m, use, name, ms, moved / ms / 1e6,
                           100 * moved / ms / 1e6 / copy, flops / ms / 1e9, error)  # fmt: skip
                    rows.append(row)
                    print(" ".join(str(v) for v in row), flush=True)
    print(f"\ncopy {copy:.0f} GB/s")
    print(f"{'T':>5} {'BM':>4} {'use':<8} {'tiles':<24} {'ms':>8} {'GB/s':>7} {'%copy':>6} "
          f"{'TFLOP/s':>8} {'rel err':>8}")  # fmt: skip
    for t, bm, use, name, ms, gbs, pct, tflops, err in rows:
        print(f"{t:>5} {bm:>4} {use:<8} {name:<24} {ms:>8.4f} {gbs:>7.0f} {pct:>6.1f} "
              f"{tflops:>8.1f} {err:>8.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
