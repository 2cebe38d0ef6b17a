"""What a GPU would compile, seen from Triton's CPU interpreter.

On a GPU, `JITFunction` compiles one variant per distinct key of a launch: the constexpr
values, each tensor's dtype and whether its address is 16-byte aligned, each integer's width
and whether it equals 1 or is divisible by 16 (unless the kernel names it in
`do_not_specialize`), and the launch options (`num_warps`, `num_stages`). The interpreter
compiles nothing, but it sees the same launches: `record_launch_keys` wraps
`InterpretedFunction.run` (the interpreter's launch) and collects those keys, so a CPU test can
check that serving launches nothing the warm-up did not (the GPU test,
`tests/models/test_no_compile_gpu.py`, counts real compiles).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_INT32 = range(-(2**31), 2**31)


def _param_key(value, is_constexpr: bool, specialize: bool, align: bool) -> tuple:
    if is_constexpr:
        return ("constexpr", repr(value))
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), align and value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("u1",)
    if isinstance(value, int):
        width = "i32" if value in _INT32 else "i64"
        if not specialize:
            return (width,)
        return (width, value == 1, value % 16 == 0)
    if isinstance(value, float):
        return ("fp32",)
    return (type(value).__name__, repr(value))


def launch_key(function, args: tuple, kwargs: dict) -> tuple:
    """The specialisation key of one launch of the interpreted kernel `function`
    (`InterpretedFunction`): its name, then one entry per parameter, then the options."""
    signature = inspect.signature(function.fn)
    names = list(signature.parameters)
    bound = signature.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in names})
    bound.apply_defaults()
    options = function.kwargs
    no_value = set(options.get("do_not_specialize") or ())
    no_align = set(options.get("do_not_specialize_on_alignment") or ())
    params = []
    for i, (name, param) in enumerate(signature.parameters.items()):
        is_constexpr = "constexpr" in str(param.annotation)
        specialize = name not in no_value and i not in no_value
        align = name not in no_align and i not in no_align
        params.append(
            (name, _param_key(bound.arguments.get(name), is_constexpr, specialize, align))
        )
    extra = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in names))
    return (function.fn.__qualname__, tuple(params), extra)


@contextmanager
def record_launch_keys() -> Iterator[set[tuple]]:
    """Collect the launch key (`launch_key`) of every interpreted launch inside the block."""
    from triton.runtime.interpreter import InterpretedFunction

    keys: set[tuple] = set()
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            keys.add(launch_key(self, args, kwargs))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield keys
    finally:
        InterpretedFunction.run = original


def describe_new_keys(new: set[tuple], known: set[tuple]) -> list[str]:
    """Per key in `new`, the kernel and the parameters in which it differs from the nearest
    key of the same kernel in `known` (what a fix must stop specialising or warm up)."""
    lines = []
    for name, params, extra in sorted(new):
        same_kernel = [k for k in known if k[0] == name]
        if not same_kernel:
            lines.append(f"{name}: never launched in the warm-up")
            continue

        def differences(other, params=params, extra=extra):
            diff = [f"{n}={v}" for (n, v), (_, w) in zip(params, other[1], strict=True) if v != w]
            return diff + ([f"options={extra}"] if extra != other[2] else [])

        lines.append(f"{name}: {', '.join(min(map(differences, same_kernel), key=len))}")
    return lines
