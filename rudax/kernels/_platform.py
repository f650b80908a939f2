"""A kernel's implementation chosen where it is lowered: Pallas for a GPU, XLA elsewhere.

``on_platform(gpu, other, *args)`` binds one primitive whose lowering rule differs by
platform: for CUDA and ROCm it lowers ``gpu`` (a Pallas call), for any other platform
``other`` (the exact XLA path, or a function that refuses). JAX emits the rule of each
platform a computation is lowered for, so one traced function exported with
``jax.export(..., platforms=["cuda", "cpu"])`` holds the Pallas kernel on its CUDA branch and
plain XLA on its CPU branch, and a CPU host can export and AOT-compile for a GPU without
pretending to be one.

Why a primitive, not ``jax.lax.platform_dependent``: in a multi-platform lowering that
lowers every kept branch for every platform (jax 0.10.2), and Pallas's CPU rule refuses a
kernel that is not interpreted. A platform-specific lowering rule is lowered with its own
platforms only (``mlir.lower_per_platform``).

Both functions take and return the same arrays: a flat list in, a tuple out, the same
shapes, dtypes and (inside ``shard_map``) the same varying mesh axes, which the primitive
reports from ``other``. The primitive has no differentiation rule: it sits inside each
kernel's ``custom_vjp`` forward and backward, whose residuals are the same on both paths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from rudax.kernels import _compat

# One implementation: arrays in, a tuple of arrays out.
Impl = Callable[..., Sequence[jax.Array]]

_GPU_PLATFORMS = ("cuda", "rocm")

on_platform_p = Primitive("rudax_on_platform")
on_platform_p.multiple_results = True


def on_platform(
    gpu: Impl, other: Impl, *args: jax.Array, name: str, other_runs: bool = True
) -> tuple[jax.Array, ...]:
    """``gpu(*args)`` where the computation is lowered for a GPU, ``other(*args)`` elsewhere.

    Args:
      gpu: the GPU implementation (a Pallas call), lowered for CUDA and ROCm only.
      other: the implementation for every other platform (the XLA path); it also gives the
        output types.
      *args: arrays, every one with the same varying mesh axes inside ``shard_map``.
      name: the op's name, for error messages.
      other_runs: False for ``impl="pallas"``: lowering for a platform other than a GPU
        raises a ValueError instead of running ``other``.

    Returns:
      The outputs, a tuple.
    """
    outs = on_platform_p.bind(*args, gpu=gpu, other=other, name=name, other_runs=other_runs)
    return tuple(outs)


def _abstract_eval(*avals: Any, other: Impl, **_: Any) -> list[Any]:
    return [_aval(o) for o in jax.eval_shape(other, *map(_struct, avals))]


def _struct(aval: Any) -> jax.ShapeDtypeStruct:
    mat = getattr(aval, "manual_axis_type", None)
    if mat is None or mat.empty:
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, sharding=aval.sharding, manual_axis_type=mat
    )


def _aval(struct: jax.ShapeDtypeStruct) -> ShapedArray:
    mat = getattr(struct, "manual_axis_type", None)
    if mat is None or mat.empty:
        return ShapedArray(struct.shape, struct.dtype)
    return ShapedArray(struct.shape, struct.dtype, sharding=struct.sharding, manual_axis_type=mat)


def _impl(*args: jax.Array, **params: Any) -> list[jax.Array]:
    """Outside jit: compiled for the devices the arrays are on, by the rules below."""
    return list(jax.jit(lambda *a: on_platform_p.bind(*a, **params))(*args))


def _batch(
    args: Sequence[jax.Array], dims: Sequence[int | None], *, gpu: Impl, other: Impl, **params: Any
) -> tuple[list[jax.Array], list[int]]:
    """vmap maps both implementations; the outputs are batched on their leading axis."""
    in_axes = tuple(dims)  # None for an argument vmap does not map
    outs = on_platform_p.bind(
        *args, gpu=jax.vmap(gpu, in_axes=in_axes), other=jax.vmap(other, in_axes=in_axes), **params
    )
    return list(outs), [0] * len(outs)


def _gpu_rule(ctx: Any, *args: Any, gpu: Impl, **_: Any) -> Any:
    return mlir.lower_fun(lambda *a: list(gpu(*a)), multiple_results=True)(ctx, *args)


def _other_rule(ctx: Any, *args: Any, other: Impl, name: str, other_runs: bool, **_: Any) -> Any:
    if not other_runs:
        platforms = ", ".join(ctx.platforms or ctx.module_context.platforms)
        raise ValueError(
            f"{name}: impl='pallas' compiles the Pallas kernel for a GPU (CUDA or ROCm), but "
            f"this computation is being lowered for {platforms}: pass impl='auto' (Pallas on "
            f"a GPU, XLA elsewhere), impl='xla', or interpret=True to interpret the kernel"
        )
    return mlir.lower_fun(lambda *a: list(other(*a)), multiple_results=True)(ctx, *args)


on_platform_p.def_abstract_eval(_abstract_eval)
on_platform_p.def_impl(_impl)
batching.primitive_batchers[on_platform_p] = _batch
mlir.register_lowering(on_platform_p, _other_rule)
for _platform in _GPU_PLATFORMS:
    mlir.register_lowering(on_platform_p, _gpu_rule, platform=_platform)


def run(path: str, pallas: Impl, xla: Impl, *args: jax.Array, name: str) -> tuple[jax.Array, ...]:
    """One step of a kernel on the path ``resolve_impl`` gave.

    ``"xla"`` and ``"interpret"`` call their function directly; ``"auto"`` and ``"pallas"``
    bind ``on_platform``, so the platform it is lowered for decides. Inside ``shard_map`` the
    arguments are first cast to vary over the same mesh axes (see ``on_platform``).
    """
    if path == "xla":
        return tuple(xla(*args))
    if path == "interpret":
        return tuple(pallas(*args))
    args = tuple(_compat.vary_like(a, *args) for a in args)
    return on_platform(pallas, xla, *args, name=name, other_runs=path == "auto")
