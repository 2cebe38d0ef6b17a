"""One EP8 rank of DeepSeek-V4.1-Flash on one GPU: ceilings, prefill, decode, roofline, profile.

    python3 benchmarks/gpu_rank.py [--prefill 4096 16384 32768] [--decode 16 64 256]
                                   [--context 8192] [--steps 5] [--profile] [--eager]
                                   [--dense-gemm {bf16,fp8,fp8-weights}]
                                   [--cuda-graph-mode {segments,step}]
                                   [--out DIR]
                                   [--prefill-expert-kernel {gluon,gluon-ws,triton}]
                                   [--decode-expert-kernel {gluon,gluon-ws,triton}]
    python3 benchmarks/gpu_rank.py --smoke            # the `tiny` preset on the CPU, seconds
    python3 benchmarks/gpu_rank.py --batch-invariant [--prefill ..] [--decode ..] [--smoke]

The configuration is `shared/design/performance.md`'s: all 40 layers at real widths, 48 routed
experts per layer with top-6 routing, Engram tables for a 2 M vocabulary, DSpark stages with 16
experts; random weights drawn on the GPU (`random_model`), routed experts kept MXFP4, the rest
bf16 (`--dense-gemm fp8`: the dense linears kept FP8, `kernels/fp8_block_gemm`; `fp8-weights`:
kept FP8 with bf16 activations, `kernels/fp8_weight_gemm` at decode sizes). It measures
the two ceilings (device copy bandwidth; bf16 and fp8 matmul rates), then:

* prefill: one sequence, one chunk of N tokens from position 0 (exact mode: every layer runs on
  every token), step time and tokens/s;
* decode: S sequences at `--context` tokens each (one sequence is prefilled, its state copied to
  the others), one new token each per step, step time (forward + greedy pick) and tokens/s;
* `--engram-vocab N`: the Engram tables' vocabulary (default 2 M: ~25 GB of tables). A lookup
  gathers 24 random rows per token whatever the size, so 500,000 (~6 GB) lets the rank fit an
  H100 and changes the lookups' cost little;

each as a percentage of the roofline: max(FLOPs / fp8 rate, bytes / bandwidth) with FLOPs and
bytes counted from the configuration (`count_work`). `--profile` adds a `torch.profiler` summary
of one decode step and one prefill chunk: top kernels by GPU time (with the model parts they ran
in), GPU time per model part, and the source lines where the step waits for the GPU. The
blocks' pure parts (all but the attention's stateful middle) replay from CUDA graphs, as the
engine runs them, unless `--eager`; graph replays run no Python, so the profile attributes
their kernels to "other". `--cuda-graph-mode step` replays each decode step whole from one CUDA
graph (`step_graph.py`, the engine's `--cuda-graph-mode step`); prefill is unchanged.
Prints one table; writes `gpu_rank.json` (and `profile_*.txt`) under `--out` (default `$OUT`).

`--batch-invariant` measures the cost of that mode instead (`Numerics.batch_invariant`): the
same prefill and decode steps on the default model, then on the same weights (same seed) built
in the mode, one model at a time; prints both step times and their ratio, writes
`batch_invariant.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import envs
from engine.models import DeepseekV41Config, Numerics, preset_config
from engine.models.deepseek_v41.config import config_with
from engine.models.deepseek_v41.random_init import MXFP4_RANDOM_SCALE_EXPONENT, random_model
from engine.models.deepseek_v41.warm_up import WarmUpStep, synthetic_batch
from kernels import grouped_mxfp4_gemm

RANK_EXPERTS = 48
RANK_DSPARK_EXPERTS = 16
RANK_ENGRAM_VOCAB = 2_000_000
SWA_ROW_BYTES = 528
GLOBAL_ROW_BYTES = 288
INDEX_ROW_BYTES = 68


def rank_config(engram_vocab: int = RANK_ENGRAM_VOCAB) -> DeepseekV41Config:
    return config_with(
        n_routed_experts=RANK_EXPERTS,
        dspark_n_routed_experts=RANK_DSPARK_EXPERTS,
        engram_vocab_size=engram_vocab,
    )


# ---------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def fill_random_experts(moe, generator: torch.Generator) -> None:
    """A quantized MoE's routed experts (made on the meta device, then `to_empty`): uniform
    MXFP4 code bytes from `generator` and every e8m0 scale `random_init`'s 2^-8."""
    with torch.no_grad():
        for tensor in moe.buffers():
            if tensor.dtype == torch.int8:
                device = tensor.device
                codes = torch.randint(-128, 128, tensor.shape, generator=generator, device=device)
                tensor.copy_(codes)
            else:
                tensor.view(torch.uint8).fill_(127 + MXFP4_RANDOM_SCALE_EXPONENT)


def time_ms(fn, device: torch.device, warmup: int = 2, repeats: int = 5) -> float:
    """Median wall time of `fn()` in ms, synchronised (CUDA events would miss host syncs)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def ceilings(device: torch.device) -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write) and bf16 / fp8 matmul rates (TFLOP/s) at 8192³."""
    if device.type != "cuda":
        return {"copy_gbs": float("nan"), "bf16_tflops": float("nan"), "fp8_tflops": float("nan")}
    n_bytes = 2 << 30
    src = torch.randn(n_bytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), device, 3, 20)
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    bf16_ms = time_ms(lambda: a @ b, device, 3, 20)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    scale_a = torch.ones(n, 1, device=device)
    scale_b = torch.ones(1, n, device=device)
    fp8_ms = time_ms(
        lambda: torch._scaled_mm(a8, b8, scale_a, scale_b, out_dtype=torch.bfloat16),
        device,
        3,
        20,
    )
    flops = 2 * n**3
    return {
        "copy_gbs": 2 * n_bytes / copy_ms / 1e6,
        "bf16_tflops": flops / bf16_ms / 1e9,
        "fp8_tflops": flops / fp8_ms / 1e9,
    }


# ---------------------------------------------------------------- counting


@dataclass(frozen=True)
class Work:
    flops: float
    bytes: float


def _step_weights(model):
    """(name, tensor) of the checkpoint tensors a target step reads (the state dict: the packed
    expert stacks are not in it, their views are); the embedding (a gather), Engram tables
    (gathers) and DSpark (off) are excluded."""
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.startswith("mtp.") or name.startswith("embed.") or ".engram." in name:
            continue
        if tensor.dtype != torch.long:
            yield name, tensor


def _weight_bytes(model) -> tuple[float, float]:
    """(bytes of the weights a target step reads, bytes of routed experts among them)."""
    total = experts = 0.0
    for name, tensor in _step_weights(model):
        size = tensor.numel() * tensor.element_size()
        total += size
        if ".ffn.experts." in name:
            experts += size
    return total, experts


def _active_params_per_token(cfg: DeepseekV41Config, model) -> float:
    per_token = 0.0
    for name, tensor in _step_weights(model):
        if tensor.dim() < 2 or name.endswith(".scale"):
            continue
        count = tensor.numel() * (2 if tensor.dtype == torch.int8 else 1)  # two e2m1 per byte
        if ".ffn.experts." in name:
            count *= cfg.num_experts_per_tok / cfg.n_routed_experts
        per_token += count
    return per_token


def _attention_flops(cfg: DeepseekV41Config, context: int) -> float:
    """Per token: QK and PV over window + selected rows, plus the indexers' scoring."""
    heads, dim = cfg.num_attention_heads, cfg.head_dim
    total = 0.0
    for layer in range(cfg.num_hidden_layers):
        rows = min(cfg.sliding_window, context)
        if cfg.ratio(layer):
            rows += min(cfg.index_topk, context // cfg.ratio(layer))
        total += 4 * heads * dim * rows
    for layer in cfg.index_source_layer_ids:
        total += 2 * cfg.index_n_heads * cfg.index_head_dim * context // cfg.ratio(layer)
    return total


def count_work(cfg: DeepseekV41Config, model, tokens: int, context: int, seqs: int) -> Work:
    """FLOPs and fewest bytes of one step computing `tokens` new tokens of `seqs` sequences whose
    attention sees about `context` positions (weights read once; KV rows read once per token)."""
    flops = tokens * (2 * _active_params_per_token(cfg, model) + _attention_flops(cfg, context))
    weights, _ = _weight_bytes(model)
    kv = 0.0
    for layer in range(cfg.num_hidden_layers):
        kv += min(cfg.sliding_window, context) * SWA_ROW_BYTES
        if cfg.ratio(layer):
            kv += min(cfg.index_topk, context // cfg.ratio(layer)) * GLOBAL_ROW_BYTES
    for layer in cfg.index_source_layer_ids:
        kv += context // cfg.ratio(layer) * INDEX_ROW_BYTES
    return Work(flops=flops, bytes=weights + seqs * kv)


# ---------------------------------------------------------------- steps


@torch.inference_mode()
def prefill(model, chunk: int, device: torch.device, steps: int) -> float:
    blocks = chunk // 128 + 1
    state = model.allocate_state(1, blocks)
    batch = synthetic_batch(WarmUpStep(1, chunk), model.config.vocab_size, device)
    return time_ms(lambda: model.forward_step(batch, state), device, 1, steps)


@torch.inference_mode()
def decode_state(model, seqs: int, context: int, device: torch.device, scratch: bool = False):
    """State for `seqs` sequences at `context` tokens: one real prefill, copied to every slot
    (scratch: with the step graphs' scratch slot and trash block, left as they are)."""
    blocks = context // 128 + 1
    state = model.allocate_state(seqs, seqs * blocks, reserve_scratch=scratch)
    prefill_batch = synthetic_batch(WarmUpStep(1, context), model.config.vocab_size, device)
    model.forward_step(prefill_batch, state)
    for rings in (state.swa, state.draft_swa):
        for ring in rings:
            ring[1:seqs] = ring[0]
    for pending in state.pending.values():
        pending[1:seqs] = pending[0]
    state.tokens[1:seqs] = state.tokens[0]
    for pool in (*state.global_kv.values(), *state.index_keys.values()):
        per_seq = pool[: seqs * blocks].view(seqs, blocks, *pool.shape[1:])
        per_seq[1:] = per_seq[0]
    return state, blocks


def decode_step_fn(model, batch, state, step_graphs: bool):
    """One decode step and its sampling's argmax: from the step graphs (`--cuda-graph-mode
    step`; raises RuntimeError if the step runs eagerly instead) or `forward_step`."""
    if not step_graphs:
        return lambda: model.forward_step(batch, state).logits.argmax(-1)
    graphs = model.enable_step_graphs(state)

    def step() -> None:
        logits = graphs.run(batch)
        if logits is None:
            raise RuntimeError(f"the step graph did not run: {graphs.graph_failures()}")
        logits.argmax(-1)

    return step


@torch.inference_mode()
def decode(
    model, seqs: int, context: int, device: torch.device, steps: int, step_graphs: bool = False
) -> float:
    state, blocks = decode_state(model, seqs, context, device, scratch=step_graphs)
    batch = synthetic_batch(WarmUpStep(seqs, 1, context), model.config.vocab_size, device)
    return time_ms(decode_step_fn(model, batch, state, step_graphs), device, 2, steps)


def batch_invariant_cost(cfg: DeepseekV41Config, device: torch.device, dtype, args) -> None:
    """Prefill and decode step times of the default mode and of `Numerics.batch_invariant` on
    the same random weights (one model built at a time); prints and saves the table."""
    from engine.models import Numerics

    cases = [("prefill", n) for n in args.prefill] + [("decode", n) for n in args.decode]
    times: dict[str, dict[str, float]] = {}
    for mode, numerics in (
        ("default", Numerics()),
        ("batch_invariant", Numerics(batch_invariant=True)),
    ):
        model = random_model(cfg, device, dtype, quantized_experts=True, numerics=numerics)
        if device.type == "cuda" and not args.eager:
            model.enable_cuda_graphs()
        for kind, n in cases:
            if kind == "prefill":
                ms = prefill(model, n, device, args.steps)
            else:
                ms = decode(model, n, args.context, device, args.steps)
            times.setdefault(f"{kind} {n}", {})[mode] = ms
            print(f"{mode} {kind} {n}: {ms:.1f} ms", flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'step':>14} {'default ms':>11} {'invariant ms':>13} {'cost':>6}")
    for case, row in times.items():
        ratio = row["batch_invariant"] / row["default"]
        print(f"{case:>14} {row['default']:>11.2f} {row['batch_invariant']:>13.2f} {ratio:>5.2f}x")
    results = {"config": "tiny (smoke)" if args.smoke else "EP8 rank", "device": str(device)}
    results["context"], results["step_ms"] = args.context, times
    (args.out / "batch_invariant.json").write_text(json.dumps(results, indent=2))


# ---------------------------------------------------------------- profile

# Model parts by submodule path (per block, and of the whole model); innermost wins. Only
# modules whose forward runs can be parts (the indexer's scoring is inside `attention`).
_BLOCK_PARTS = {
    "attn": "attention",
    "attn.compressor": "attention.compressor",
    "ffn": "moe",
    "ffn.shared_experts": "moe.shared",
    "engram": "engram",
}
_MODEL_PARTS = {"embed": "embedding"}


# Attention methods a block calls directly (no module call, so no hooks): wrapped instead.
_ATTENTION_STEPS = ("project", "attend", "output")


@contextlib.contextmanager
def _part_ranges(model):
    """Profiler ranges around each model part (forward hooks and per-instance method wrappers,
    removed afterwards; the model's code is unchanged). Graph-replayed parts run no Python, so
    their kernels fall outside every range."""
    modules = [(model.get_submodule(path), part) for path, part in _MODEL_PARTS.items()]
    for block in model.layers:
        for path, part in _BLOCK_PARTS.items():
            with contextlib.suppress(AttributeError):
                modules.append((block.get_submodule(path), part))
        for step in _ATTENTION_STEPS:
            method = getattr(block.attn, step)

            def ranged(*args, method=method, **kwargs):
                with torch.profiler.record_function("part:attention"):
                    return method(*args, **kwargs)

            setattr(block.attn, step, ranged)
    handles, open_ranges = [], []
    for module, part in modules:

        def enter(_m, _args, part=part) -> None:
            context = torch.profiler.record_function(f"part:{part}")
            context.__enter__()
            open_ranges.append(context)

        def leave(_m, _args, _out) -> None:
            open_ranges.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for block in model.layers:
            for step in _ATTENTION_STEPS:
                delattr(block.attn, step)


def _part_of(event) -> str:
    """The innermost `part:` range around a profiler event, or "other"."""
    while event is not None:
        if event.name.startswith("part:"):
            return event.name.removeprefix("part:")
        event = event.cpu_parent
    return "other"


def _kernel_times(prof, on_cuda: bool) -> list[tuple[str, str, float]]:
    """(kernel, model part, µs) for every kernel of the trace.

    GPU: every device event, attributed to the innermost device-side `part:` range containing
    its start. (Attribution through the launching CPU op misses kernels launched through the
    driver API, as Triton launches them.) CPU: each op's self time, attributed through its
    parents.
    """
    if not on_cuda:
        return [
            (event.name, _part_of(event), event.self_cpu_time_total)
            for event in prof.events()
            if event.self_cpu_time_total > 0 and not event.name.startswith("part:")
        ]
    device_events = [
        event
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA and event.time_range.elapsed_us()
    ]
    ranges = sorted(
        (e.time_range.start, e.time_range.end, e.name.removeprefix("part:"))
        for e in device_events
        if e.name.startswith("part:")
    )
    times = []
    for event in device_events:
        if event.name.startswith("part:"):
            continue
        start = event.time_range.start
        # Ranges sorted by start: the last one containing `start` is the innermost.
        part = next(
            (name for lo, hi, name in reversed(ranges) if lo <= start < hi),
            "other",
        )
        times.append((event.name, part, event.time_range.elapsed_us()))
    return times


def profile(model, fn, device: torch.device, title: str, out: Path | None) -> str:
    """Profile one call of `fn`: the top ten kernels (with the model parts they ran in) and the
    kernel time per model part; written to `out` too, with every kernel listed."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    fn()
    _sync(device)
    with _part_ranges(model), torch.profiler.profile(activities=activities) as prof:
        wall = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - wall
    times = _kernel_times(prof, device.type == "cuda")
    total = sum(us for _, _, us in times) or 1.0
    by_kernel: dict[str, dict[str, float]] = {}
    calls: dict[str, int] = {}
    for name, part, us in times:
        by_kernel.setdefault(name, {}).setdefault(part, 0.0)
        by_kernel[name][part] += us
        calls[name] = calls.get(name, 0) + 1
    unit = "GPU" if device.type == "cuda" else "CPU"
    head = (
        f"## {title}: {len(times)} kernels, {total / 1e3:.2f} ms of {unit} time, "
        f"{wall * 1e3:.2f} ms wall (profiled)"
    )
    lines = [head, f"{'ms':>9} {'share':>6} {'calls':>6}  kernel  [parts]"]
    ranked = sorted(by_kernel.items(), key=lambda item: sum(item[1].values()), reverse=True)
    rows = []
    for name, parts in ranked:
        us = sum(parts.values())
        where = ", ".join(
            f"{part} {t / us:.0%}" for part, t in sorted(parts.items(), key=lambda i: -i[1])
        )
        rows.append((f"{us / 1e3:>9.2f} {us / total:>6.1%} {calls[name]:>6}", name, where))
    lines += [f"{numbers}  {name[:80]}  [{where}]" for numbers, name, where in rows[:10]]
    per_part: dict[str, float] = {}
    launches: dict[str, int] = {}
    for _, part, us in times:
        per_part[part] = per_part.get(part, 0.0) + us
        launches[part] = launches.get(part, 0) + 1
    lines.append(f"## {title}: {unit} time and kernel count per model part")
    for part, us in sorted(per_part.items(), key=lambda i: -i[1]):
        lines.append(f"{us / 1e3:>9.2f} {us / total:>6.1%} {launches[part]:>6}  {part}")
    text = "\n".join(lines)
    if out is not None:  # the file: every kernel, whole names
        every = [f"{numbers}  {name[:200]}  [{where}]" for numbers, name, where in rows]
        path = out / f"profile_{title.replace(' ', '_')}.txt"
        path.write_text("\n".join((text, f"## {title}: every kernel", *every)) + "\n")
    return text


def host_syncs(fn) -> list[str]:
    """Source lines where `fn()` made the host wait for the GPU (CUDA sync debug mode)."""
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites: dict[str, int] = {}
    for warning in caught:
        message = str(warning.message)
        # not the mode's own once-per-process notice ("... is a prototype feature ...", raised
        # at torch/cuda/__init__.py), which the H200 runs up to 2026-12-01 counted as the one
        # host wait left in a decode step
        if "synchroniz" in message and "prototype feature" not in message:
            site = f"{Path(warning.filename).name}:{warning.lineno}"
            sites[site] = sites.get(site, 0) + 1
    return [f"{site} ({count}x)" for site, count in sorted(sites.items())]


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, nargs="*", default=[4096, 16384, 32768])
    parser.add_argument("--decode", type=int, nargs="*", default=[16, 64, 256])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny preset on the CPU")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--cuda-graph-mode",
        choices=["segments", "step"],
        default="segments",
        help="step: decode steps replay whole from one CUDA graph each (`step_graph.py`)",
    )
    parser.add_argument("--dense-gemm", choices=["bf16", "fp8", "fp8-weights"], default="bf16")
    for phase, blocks in (("prefill", "blocks of 128 rows"), ("decode", "decode blocks")):
        parser.add_argument(
            f"--{phase}-expert-kernel",
            choices=["gluon", "gluon-ws", "triton"],
            default=None,
            help=f"the expert GEMM's kernel for {blocks} (`grouped_mxfp4_gemm."
            f"{phase.upper()}_KERNEL`; default: the launcher's choice)",
        )
    parser.add_argument(
        "--engram-vocab",
        type=int,
        default=RANK_ENGRAM_VOCAB,
        help="Engram vocabulary (tables of ~12.7 GB a layer at 2 M; 500000 fits an H100)",
    )
    parser.add_argument("--out", type=Path, default=envs.benchmark_out_dir())
    parser.add_argument(
        "--batch-invariant", action="store_true", help="step times with and without the mode"
    )
    args = parser.parse_args()
    if args.smoke:
        cfg, device, dtype = preset_config("tiny"), torch.device("cpu"), torch.float32
    else:
        cfg, device, dtype = rank_config(args.engram_vocab), torch.device("cuda"), torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    if args.batch_invariant:
        batch_invariant_cost(cfg, device, dtype, args)
        return
    results: dict = {"config": "tiny (smoke)" if args.smoke else "EP8 rank", "device": str(device)}
    results["engram_vocab"] = cfg.engram_vocab_size

    def save() -> None:
        (args.out / "gpu_rank.json").write_text(json.dumps(results, indent=2))

    start = time.perf_counter()
    limits = results["ceilings"] = ceilings(device)
    print(f"ceilings: {json.dumps({k: round(v, 1) for k, v in limits.items()})}", flush=True)
    numerics = Numerics(
        dense_fp8=args.dense_gemm != "bf16", dense_fp8_activations=args.dense_gemm == "fp8"
    )
    results["dense_gemm"] = args.dense_gemm
    if args.prefill_expert_kernel:  # a benchmark's A/B: the module's choice for this process
        grouped_mxfp4_gemm.PREFILL_KERNEL = args.prefill_expert_kernel
    if args.decode_expert_kernel:
        grouped_mxfp4_gemm.DECODE_KERNEL = args.decode_expert_kernel
    results["prefill_expert_kernel"] = grouped_mxfp4_gemm.PREFILL_KERNEL
    results["decode_expert_kernel"] = grouped_mxfp4_gemm.DECODE_KERNEL
    model = random_model(cfg, device, dtype, quantized_experts=True, numerics=numerics)
    results["cuda_graphs"] = device.type == "cuda" and not args.eager
    step_graphs = results["cuda_graphs"] and args.cuda_graph_mode == "step"
    results["cuda_graph_mode"] = args.cuda_graph_mode if results["cuda_graphs"] else "eager"
    if results["cuda_graphs"]:
        model.enable_cuda_graphs()
    weights, experts = _weight_bytes(model)
    results["weights_gb"] = weights / 1e9
    results["expert_weights_gb"] = experts / 1e9
    if device.type == "cuda":
        results["memory_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
    print(
        f"model built in {time.perf_counter() - start:.0f} s: weights read per step "
        f"{weights / 1e9:.1f} GB (experts {experts / 1e9:.1f} GB)",
        flush=True,
    )
    save()
    fp8 = limits["fp8_tflops"] * 1e12
    bandwidth = limits["copy_gbs"] * 1e9

    def roofline(work: Work) -> float:
        return max(work.flops / fp8, work.bytes / bandwidth) * 1e3

    rows = []
    for chunk in args.prefill:
        try:
            ms = prefill(model, chunk, device, args.steps)
        except torch.OutOfMemoryError:
            rows.append(("prefill", chunk, None, None, None))
            torch.cuda.empty_cache()
            continue
        floor = roofline(count_work(cfg, model, chunk, chunk // 2, 1))
        rows.append(("prefill", chunk, ms, chunk / ms * 1e3, floor / ms))
        print(f"prefill {chunk}: {ms:.1f} ms", flush=True)
        results.setdefault("prefill", []).append(
            {"chunk": chunk, "step_ms": ms, "tokens_s": chunk / ms * 1e3, "roofline_ms": floor}
        )
        save()
    for seqs in args.decode:
        try:
            ms = decode(model, seqs, args.context, device, args.steps, step_graphs)
        except torch.OutOfMemoryError:
            rows.append(("decode", seqs, None, None, None))
            torch.cuda.empty_cache()
            continue
        floor = roofline(count_work(cfg, model, seqs, args.context, seqs))
        rows.append(("decode", seqs, ms, seqs / ms * 1e3, floor / ms))
        print(f"decode {seqs}: {ms:.1f} ms", flush=True)
        results.setdefault("decode", []).append(
            {
                "seqs": seqs,
                "context": args.context,
                "step_ms": ms,
                "tokens_s": seqs / ms * 1e3,
                "roofline_ms": floor,
            }
        )
        save()
    if results["cuda_graphs"]:
        failures = results["graph_failures"] = model.graph_failures()
        print(f"CUDA graph captures that failed: {failures or 'none'}", flush=True)
        save()
    if args.profile:
        seqs = args.decode[len(args.decode) // 2] if args.decode else 16
        state, blocks = decode_state(model, seqs, args.context, device, scratch=step_graphs)
        chunk = args.prefill[0] if args.prefill else 4096
        chunk_blocks = chunk // 128 + 1
        decode_batch = synthetic_batch(WarmUpStep(seqs, 1, args.context), cfg.vocab_size, device)
        prefill_state = model.allocate_state(1, chunk_blocks)
        cases = [
            (
                f"decode {seqs} seqs",
                decode_step_fn(model, decode_batch, state, step_graphs),
            ),
            (
                f"prefill {chunk}",
                functools.partial(
                    model.forward_step,
                    synthetic_batch(WarmUpStep(1, chunk), cfg.vocab_size, device),
                    prefill_state,
                ),
            ),
        ]
        for title, step in cases:
            with torch.inference_mode():
                print(profile(model, step, device, title, args.out))
                if device.type == "cuda":
                    syncs = results.setdefault("host_syncs", {})[title] = host_syncs(step)
                    print(f"## {title}: host syncs inside the step: {syncs or 'none'}")
    ceiling_text = json.dumps({k: round(v, 1) for k, v in limits.items()})
    print(f"\n{results['config']} on {device}: {ceiling_text}")
    print(f"{'phase':<8} {'size':>6} {'step ms':>10} {'tokens/s':>10} {'% roofline':>11}")
    for phase, size, ms, rate, share in rows:
        if ms is None:
            print(f"{phase:<8} {size:>6} {'OOM':>10}")
            continue
        print(f"{phase:<8} {size:>6} {ms:>10.1f} {rate:>10.0f} {share:>10.2%}")


if __name__ == "__main__":
    main()
