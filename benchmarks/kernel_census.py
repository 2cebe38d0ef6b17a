"""Kernel launches of one decode step of the EP8-rank layout, counted on the CPU.

    python3 benchmarks/kernel_census.py [--seqs 64] [--context 512] [--top 40] [--out DIR]

The model takes its CUDA code paths on the CPU: Triton runs its interpreter (the script starts
itself again with Triton's `TRITON_INTERPRET=1` when it is not set), so every `runs_kernels`
branch takes the Triton kernel, as on a GPU; and the bf16 GEMMs with fp32 output that only
CUDA's torch has are provided on the CPU (`provide_bf16_gemms_to_fp32_on_cpu`), so the fp32
products of bf16 weights (`dense.fp32_on_tensor_cores`) take their tensor-core branch too.
The layer layout is the released one (40 layers, the same compress ratios, KV / index /
candidate sources, Engram layers, DSpark targets) at the `tiny` preset's widths: how many
kernels a step launches depends on the layout and the code paths, not on the widths (no loop
here splits its work by size at these batch sizes; `gpu_rank --profile` counts the real ones).

Counted, per source line of `engine/` or `kernels/` that issued them:

* every Triton launch (one kernel each);
* every aten op that launches a device kernel: all but views, aliases, allocations and
  metadata queries; an op that may return its input (`to`, `reshape`, `contiguous`) counts
  when it copied (a dtype conversion), not when it returned a view (a same-dtype `to`). On
  CUDA an op may launch more than one kernel (a cuBLAS GEMM with a split-K reduction, a sort
  or a top-k in several passes), so the total is an estimate of the GPU's count, good for
  finding where launches come from and for seeing a change move them; `gpu_rank --profile`
  on the GPU gives the exact count.

Prints the total, the count per model file and function, and the `--top` source lines (with
`--callers N`, each with its N nearest callers in the model); writes
`kernel_census.json` under `--out` (default `$OUT`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

if __name__ == "__main__" and os.environ.get("TRITON_INTERPRET") != "1":
    # Triton reads its own variable once, when it is imported: start again with it set.
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"})

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from engine import envs  # noqa: E402
from engine.models import DeepseekV41Config, preset_config  # noqa: E402
from engine.models.deepseek_v41.random_init import random_model  # noqa: E402
from engine.models.deepseek_v41.warm_up import WarmUpStep, synthetic_batch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
_OWN_DIRS = (str(REPO / "engine"), str(REPO / "kernels"))
_RELEASED_LAYOUT = (
    "num_hidden_layers",
    "compress_ratios",
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "candidate_source_layer_id",
    "engram_layer_ids",
    "dspark_target_layer_ids",
    "num_nextn_predict_layers",
)
# aten ops that never launch a kernel: allocations and metadata. (Views are found from their
# schemas: an output that aliases an input without writing it.)
_NO_KERNEL = {
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::lift_fresh",
    "aten::sym_size",
    "aten::sym_stride",
    "aten::sym_numel",
    "aten::is_nonzero",
    "aten::_local_scalar_dense",  # a copy to the host (and a sync), not a kernel
    "aten::resize_",
    "aten::set_",
}


def census_config() -> DeepseekV41Config:
    """The released layer layout at the `tiny` preset's widths."""
    released = DeepseekV41Config()
    return preset_config("tiny", **{key: getattr(released, key) for key in _RELEASED_LAYOUT})


def provide_bf16_gemms_to_fp32_on_cpu() -> torch.library.Library:
    """Give this process's CPU torch the bf16 GEMMs with fp32 output that only its CUDA build
    has (`mm` / `bmm` with `out_dtype=torch.float32`), computed as fp32 GEMMs of the exact bf16
    values, so that the model's tensor-core branches (`dense.fp32_on_tensor_cores`: the fp32
    products of bf16 weights) run on the CPU as on a GPU. The census sees each as the one op
    the GPU launches (a dispatch mode does not see the ops inside another op's kernel).

    Call it before the model's first product (`dense.bf16_mm_to_fp32_runs` asks once per
    device) and keep the returned library: the kernels are removed with it.
    """
    library = torch.library.Library("aten", "IMPL")
    library.impl("mm.dtype", _mm_to_fp32, "CPU")
    library.impl("bmm.dtype", _bmm_to_fp32, "CPU")
    return library


def _mm_to_fp32(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or out_dtype != torch.float32:
        raise NotImplementedError(f"mm {a.dtype} x {b.dtype} -> {out_dtype}")
    return torch.mm(a.float(), b.float())


def _bmm_to_fp32(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or out_dtype != torch.float32:
        raise NotImplementedError(f"bmm {a.dtype} x {b.dtype} -> {out_dtype}")
    return torch.bmm(a.float(), b.float())


def _launches_kernel(func, args, kwargs, out) -> bool:
    """Whether the aten op `func`, called on (args, kwargs) with result `out`, launched a
    kernel: not an allocation or metadata query (`_NO_KERNEL`), not a view. An op that may
    return an alias of its input (`to`, `reshape`, `contiguous`: an output annotated as an
    alias that is not written) copied, hence launched, when an output holds storage of its
    own: a `to` that changes the dtype is a kernel, a same-dtype `to` none."""
    name = func._schema.name
    if name in _NO_KERNEL:
        return False
    returns = func._schema.returns
    aliasing = [r.alias_info for r in returns if r.alias_info is not None]
    if not aliasing or any(info.is_write for info in aliasing):
        return True
    inputs = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return any(t.numel() and _storage(t) not in inputs for t in outputs)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _issuer(depth: int = 1) -> str:
    """`file:line (function)` of the innermost frame in engine/ or kernels/, and of its
    `depth − 1` nearest callers there (joined by " < ")."""
    frame, found = sys._getframe(2), []
    while frame is not None and len(found) < depth:
        code = frame.f_code
        if code.co_filename.startswith(_OWN_DIRS):
            where = Path(code.co_filename).relative_to(REPO)
            found.append(f"{where}:{frame.f_lineno} ({code.co_name})")
        frame = frame.f_back
    return " < ".join(found) or "(outside the model)"


class LaunchCensus(TorchDispatchMode):
    """Counts kernel launches by issuing source line: aten ops and Triton launches."""

    def __init__(self, depth: int = 1) -> None:
        super().__init__()
        self.depth = depth
        self.by_line: Counter[str] = Counter()
        self.by_op: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()
        self._inside_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._inside_triton:
            if func._schema.name == "aten::_local_scalar_dense":
                self.host_reads[_issuer()] += 1
            elif _launches_kernel(func, args, kwargs, out):
                self.by_line[_issuer(self.depth)] += 1
                self.by_op[func._schema.name] += 1
        return out

    def triton_launch(self, name: str) -> None:
        if not self._inside_triton:
            self.by_line[_issuer(self.depth)] += 1
            self.by_op[f"triton::{name}"] += 1

    def enter_triton(self) -> None:
        self._inside_triton += 1

    def leave_triton(self) -> None:
        self._inside_triton -= 1


def _count_triton_launches(census: LaunchCensus):
    """Patch the interpreter's launch so each counts once (its own tensor work not at all)."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        if kwargs.get("warmup"):
            return original(self, *args, **kwargs)
        census.triton_launch(self.fn.__name__)
        census.enter_triton()
        try:
            return original(self, *args, **kwargs)
        finally:
            census.leave_triton()

    InterpretedFunction.run = run
    return lambda: setattr(InterpretedFunction, "run", original)


def _by_function(by_line: Counter[str]) -> Counter[str]:
    out: Counter[str] = Counter()
    for line, count in by_line.items():
        path, _, rest = line.partition(" < ")[0].partition(":")
        function = rest.partition(" ")[2]
        out[f"{path} {function}"] += count
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument(
        "--callers", type=int, default=0, help="also name this many callers of each line"
    )
    parser.add_argument("--out", type=Path, default=envs.benchmark_out_dir())
    args = parser.parse_args()
    cfg = census_config()
    device = torch.device("cpu")
    gemms = provide_bf16_gemms_to_fp32_on_cpu()  # noqa: F841 (kept: the kernels live with it)
    start = time.perf_counter()
    model = random_model(cfg, device, torch.bfloat16, quantized_experts=True)
    with torch.inference_mode():
        # Fresh (zero) state: what the rows hold changes no launch, and a prefill in the
        # interpreter would take most of the run.
        blocks = args.context // 128 + 1
        state = model.allocate_state(args.seqs, args.seqs * blocks)
        batch = synthetic_batch(WarmUpStep(args.seqs, 1, args.context), cfg.vocab_size, device)
        model.forward_step(batch, state).logits.argmax(-1)  # warm: lazy buffers, caches
        census = LaunchCensus(1 + args.callers)
        restore = _count_triton_launches(census)
        try:
            with census:
                model.forward_step(batch, state).logits.argmax(-1)
        finally:
            restore()
    total = sum(census.by_line.values())
    functions = _by_function(census.by_line)
    lines = [
        f"## decode {args.seqs} seqs at {args.context} tokens, {cfg.num_hidden_layers} layers: "
        f"{total} launches (CPU census, {time.perf_counter() - start:.0f} s)",
        "## per function",
        *(f"{n:>7}  {name}" for name, n in functions.most_common()),
        f"## top {args.top} source lines",
        *(f"{n:>7}  {line}" for line, n in census.by_line.most_common(args.top)),
        "## per op",
        *(f"{n:>7}  {op}" for op, n in census.by_op.most_common(args.top)),
    ]
    if census.host_reads:
        lines += ["## host reads of device values (.item(): a sync on CUDA)"]
        lines += [f"{n:>7}  {line}" for line, n in census.host_reads.most_common()]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "seqs": args.seqs,
        "context": args.context,
        "layers": cfg.num_hidden_layers,
        "launches": total,
        "per_function": dict(functions.most_common()),
        "per_line": dict(census.by_line.most_common()),
        "per_op": dict(census.by_op.most_common()),
        "host_reads": dict(census.host_reads),
    }
    (args.out / "kernel_census.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
