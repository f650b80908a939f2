"""GPU lowering checks that run on a CPU host: a kernel exported for ``platforms=["cuda"]``.

Interpret mode hides what only the GPU lowering checks (power-of-two block shapes, supported
primitives inside the kernel, Triton's tensor-size limit). Exporting for CUDA runs that
lowering here, without a GPU: the kernels choose Pallas where they are lowered for CUDA, so
``impl="pallas"`` (or ``"auto"``) exports from this CPU host as it is. The export must
contain rudax's GPU custom call and, by name, every Pallas kernel the caller expects, so an
op that quietly fell back to XLA cannot pass.

Usage, in a kernel's test file::

    assert_lowers_for_gpu(
        lambda x, s: rk.rms_norm(x, s, impl="pallas"),
        jax.ShapeDtypeStruct((5, 96), jnp.bfloat16),
        jax.ShapeDtypeStruct((96,), jnp.float32),
        kernels=["rms_norm_fwd"],
        backward_kernels=["rms_norm_bwd"],
    )
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

import rudax.kernels as rk
from rudax.kernels import _compat


def export(
    fn: Callable[..., Any], *args: Any, platforms: Sequence[str] = ("cuda",)
) -> jax.export.Exported:
    """``jax.export`` of ``jax.jit(fn)`` for ``platforms``, GPU custom calls allowed, the
    target GPU named as a user exporting from a CPU host names it (jax 0.11 needs it)."""
    with rk.gpu_export_target("NVIDIA H100"):
        return jax.export.export(
            jax.jit(fn),
            platforms=list(platforms),
            disabled_checks=rk.EXPORT_DISABLED_CHECKS,
        )(*args)


def gpu_calls(text: str) -> int:
    """How many Pallas GPU kernel calls an export's StableHLO text holds."""
    return text.count(f"custom_call @{_compat.GPU_CUSTOM_CALL_TARGET}(")


def _export_text(fn: Callable[..., Any], *args: jax.ShapeDtypeStruct) -> str:
    return export(fn, *args).mlir_module()


def _check(text: str, kernels: Sequence[str], what: str) -> None:
    calls = gpu_calls(text)
    assert calls >= max(1, len(kernels)), (
        f"{what}: expected {max(1, len(kernels))} GPU kernel call(s) "
        f"({_compat.GPU_CUSTOM_CALL_TARGET}), found {calls}: did the op fall back to XLA?"
    )
    names = set(re.findall(r'name = "([^"]*)"', text))
    missing = [k for k in kernels if k not in names]
    assert not missing, f"{what}: kernels {missing} not in the export (found {sorted(names)})"


def assert_lowers_for_gpu(
    fn: Callable[..., Any],
    *args: jax.ShapeDtypeStruct,
    kernels: Sequence[str] = (),
    backward_kernels: Sequence[str] | None = None,
) -> str:
    """Exports ``fn`` (and its VJP) for CUDA and checks the Pallas kernels are in it.

    Args:
      fn: the op with ``impl="pallas"`` (and ``interpret=False``), arrays as its arguments.
      *args: a ``jax.ShapeDtypeStruct`` per argument of ``fn``.
      kernels: names (``pallas_call(name=...)``) that the forward export must contain.
      backward_kernels: names that the export of ``jax.vjp(fn, *args)``'s backward must
        contain; None skips the backward. The VJP is taken with respect to every floating
        argument, with a cotangent of ``fn``'s output structure as an extra input.

    Returns:
      The forward export's StableHLO text, for further checks.
    """
    forward = _export_text(fn, *args)
    _check(forward, kernels, "forward")
    if backward_kernels is None:
        return forward
    floating = [jnp.issubdtype(a.dtype, jnp.floating) for a in args]
    out = jax.eval_shape(fn, *args)

    def backward(primals: tuple[Any, ...], cotangent: Any) -> Any:
        def of_floating(*xs: Any) -> Any:
            it = iter(xs)
            full = [next(it) if f else p for p, f in zip(primals, floating, strict=True)]
            return fn(*full)

        diff = [p for p, f in zip(primals, floating, strict=True) if f]
        _, vjp = jax.vjp(of_floating, *diff)
        return vjp(cotangent)

    text = _export_text(backward, tuple(args), out)
    _check(text, backward_kernels, "backward")
    return forward
