"""The one place where rudax.kernels meets JAX versions and backends.

Every kernel module asks this file which path its ``impl`` means (``resolve_impl``), how to
call ``pallas_call`` for the GPU (``pallas_call``, ``gpu_compiler_params``) and how to read
and write a masked block (``load``, ``store``); tests ask it what a GPU export contains
(``GPU_CUSTOM_CALL_TARGET``, ``EXPORT_DISABLED_CHECKS``). No other kernel file imports a
backend-specific Pallas module.

Why the Triton lowering. rudax's GPU kernels are memory-bound row kernels (a row reduction
followed by an elementwise pass, or a pure elementwise pass) over arbitrary feature sizes.

* Pallas's Triton lowering lowers them for any power-of-two block with masked loads and
  stores, so a feature size such as 100 or 4095 is read in place, padding masked, no padded
  copy made. It is what JAX's own ``pallas/ops/gpu`` norms used. JAX 0.11's Pallas changelog
  deprecates it: "will be removed in a future version of JAX. To keep using Pallas on GPU,
  please migrate to the Mosaic GPU backend. To keep using Triton, switch to the official
  Triton bindings and jax_triton." Deprecated is not removed: 0.11 still ships it, and it is
  the lowering of the two that takes these kernels today. (Checked by lowering for CUDA
  on a CPU host, jax 0.10.2, and run on an H200, jax 0.11.2: ``docs/gpu_results.md``.)
* Mosaic GPU, the lowering ``pallas_call`` picks without compiler params, does not lower them
  here (jax 0.10.2): a row reduction of a 2-D block fails with "No support for axes yet", and
  its TMA copies need every global-memory stride but the last to be a multiple of 16 bytes,
  so a bf16 row of 100 features cannot be read without a padded copy. Using ``pallas_call``
  for Mosaic GPU is itself deprecated in favour of ``plgpu.kernel``.

So rudax asks for Triton explicitly (Triton ``CompilerParams``, which also overrides the
``jax_pallas_use_mosaic_gpu`` flag). When a JAX release drops ``jax.experimental.pallas.triton``,
``gpu_lowering_available()`` turns False here and only here: ``impl="auto"`` then runs the exact
XLA path and ``impl="pallas"`` says why it cannot; a Mosaic GPU port would slot in behind the
same functions. The Triton module's deprecation warnings at import and at ``CompilerParams``
(jax 0.10.x) are silenced here, on purpose and only here, because the choice above is
deliberate. jax 0.11.0 warns instead when a kernel is lowered, inside ``jax.jit``'s
compilation, which no code here wraps: on 0.11 a GPU compile shows that DeprecationWarning
once (``docs/versions.md``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal, overload

import jax
from jax.experimental import pallas as pl
from jax.typing import ArrayLike

from rudax._validation import check_bool, check_impl
from rudax.kernels import _target
from rudax.kernels._auto import auto_takes_pallas

_triton: ModuleType | None
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        from jax.experimental.pallas import triton as _triton
    except ImportError:  # a JAX release without the Triton backend
        _triton = None

# The custom call a Pallas Triton kernel becomes in exported StableHLO. jax.export refuses
# custom calls without a stability guarantee unless told, hence EXPORT_DISABLED_CHECKS.
# jax 0.11.0 publishes the name (Pallas changelog: "always aligned with what the lowering
# emits"), behind a switch that may change it; jax 0.10.2 has no constant, and emits this one.
GPU_CUSTOM_CALL_TARGET: str = getattr(_triton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
EXPORT_DISABLED_CHECKS: tuple[jax.export.DisabledSafetyCheck, ...] = (
    jax.export.DisabledSafetyCheck.custom_call(GPU_CUSTOM_CALL_TARGET),
)


def gpu_lowering_available() -> bool:
    """True when this JAX can lower rudax's Pallas kernels for the GPU (Triton)."""
    return _triton is not None


Path = Literal["auto", "pallas", "interpret", "xla"]


def resolve_impl(
    impl: str,
    *,
    interpret: bool = False,
    kernel: str | None = None,
    size: int | None = None,
    dtype: Any = None,
) -> Path:
    """Turns a kernel's ``impl`` argument into the path its jitted body takes.

    Nothing here asks which backend is the default: the choice between Pallas and XLA is
    made where the computation is lowered, per platform (``rudax.kernels._platform``).

    * ``"auto"``: Pallas where lowered for a GPU, XLA elsewhere; ``"xla"`` when this JAX has
      no GPU lowering for Pallas, or when ``kernel``'s Pallas path was measured slower than
      its XLA path on the GPU lowered for (``rudax.kernels._auto``: the row of ``kernel``
      nearest ``size`` and ``dtype``).
    * ``"pallas"``: Pallas for a GPU; lowering for any other platform raises.
    * ``"interpret"`` (``impl="pallas", interpret=True``): Pallas in interpret mode, anywhere.
    * ``"xla"``: the pure-jnp path.

    Args:
      impl: ``"auto"``, ``"pallas"`` or ``"xla"``.
      interpret: whether Pallas, where it runs, runs in interpret mode.
      kernel: the kernel's name in the measured table, for ``"auto"``.
      size: the call's size class (``rudax.kernels._auto``: features, or parameters).
      dtype: the call's input dtype.

    Returns:
      The path. A ValueError for any other ``impl``, or for ``"pallas"`` without
      ``interpret`` when this JAX has no GPU lowering.

    Example:
      >>> resolve_impl("xla")
      'xla'
      >>> resolve_impl("pallas", interpret=True)
      'interpret'
    """
    check_bool("interpret", interpret, allow_numpy=False)
    check_impl(impl)
    if impl == "xla":
        return "xla"
    if impl == "auto":
        pallas = gpu_lowering_available() and (
            kernel is None
            or auto_takes_pallas(kernel, size=size, dtype=dtype, gpu=_target.target_gpu())
        )
        return "auto" if pallas else "xla"
    if interpret:
        return "interpret"
    if not gpu_lowering_available():
        raise ValueError(
            f"impl='pallas' needs Pallas's Triton lowering, which jax {jax.__version__} does "
            f"not ship: pass impl='xla' (or 'auto')"
        )
    return "pallas"


def gpu_compiler_params(*, num_warps: int = 4, num_stages: int = 1) -> Any:
    """The ``compiler_params`` for rudax's GPU lowering (Triton).

    ``num_stages=1``: rudax's row kernels have no loop for Triton to software-pipeline, so
    more stages would only reserve shared memory.

    Returns None when this JAX has no Triton backend (only interpret mode can run then).
    """
    for name, value in (("num_warps", num_warps), ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    if num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two, got {num_warps=}")
    if _triton is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return _triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(
    kernel: Callable[..., None],
    *,
    out_shape: Any,
    grid: tuple[int, ...],
    in_specs: Any = pl.no_block_spec,
    out_specs: Any = pl.no_block_spec,
    interpret: bool,
    num_warps: int = 4,
    num_stages: int = 1,
    name: str | None = None,
    input_output_aliases: dict[int, int] | None = None,
) -> Callable[..., Any]:
    """``pl.pallas_call`` with rudax's GPU lowering chosen (see the module docstring).

    Without ``in_specs``/``out_specs`` every kernel sees whole arrays and indexes them itself.
    ``input_output_aliases``: {input index: output index} written in place (where the caller
    donates the input; XLA copies it first otherwise).
    """

    def call(*args: Any) -> Any:
        return pl.pallas_call(
            kernel,
            out_shape=_typed_like(out_shape, args),
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            interpret=interpret,
            name=name,
            compiler_params=gpu_compiler_params(num_warps=num_warps, num_stages=num_stages),
            input_output_aliases=input_output_aliases or {},
        )(*args)

    return call


def _typed_like(out_shape: Any, args: tuple) -> Any:
    """Gives each output struct the manual-axis type of the most varying input.

    Inside ``shard_map`` (``check_vma=True``) Pallas needs to know how its outputs vary over
    the mesh axes; the kernels compute per rank on per-rank operands, so their outputs vary
    as their inputs do. Outside ``shard_map`` the structs are left as they are.
    """
    mats = [_manual_axis_type(jax.typeof(a)) for a in jax.tree.leaves(args)]
    varying = [m for m in mats if m is not None and getattr(m, "varying", None)]
    if not varying:
        return out_shape
    mat = max(varying, key=lambda m: len(m.varying))
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat), out_shape
    )


def load(ref: Any, *, mask: jax.Array | None = None, other: Any = None) -> jax.Array:
    """Reads a block, positions where ``mask`` is False read as ``other``.

    The Triton lowering computes addresses from the full array's strides and does not clip a
    block at the array's edge: a read past the last column lands in the next row, so every
    block that may overhang the array must be read (and written) under a mask.
    """
    if _triton is not None:
        return _triton.load(ref, mask=mask, other=other)
    # Interpret mode without the Triton module: read the whole block and select.
    x = ref[...]
    if mask is None or other is None:
        return x
    return jax.numpy.where(mask, x, other)


def store(ref: Any, value: jax.Array, *, mask: jax.Array | None = None) -> None:
    """Writes a block, positions where ``mask`` is False left untouched (see ``load``)."""
    if _triton is not None:
        _triton.store(ref, value, mask=mask)
        return
    ref[...] = value if mask is None else jax.numpy.where(mask, value, ref[...])


def varying_axes(x: ArrayLike) -> frozenset[Any]:
    """The mesh axes ``x`` varies over inside ``shard_map``; empty outside it or without
    ``check_vma``. jax 0.10 and 0.11 keep the set in ``aval.manual_axis_type.varying``,
    earlier releases in ``aval.vma``. Public as ``rudax.sharding.varying_axes``.

    Args:
      x: an array or tracer.

    Returns:
      A frozenset of mesh axis names (any hashables, as ``jax.sharding.Mesh`` takes them).

    Example:
      >>> import jax.numpy as jnp
      >>> import rudax.sharding as rs
      >>> rs.varying_axes(jnp.ones(3))  # outside shard_map nothing varies
      frozenset()
    """
    mat = _manual_axis_type(jax.typeof(x))
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(jax.typeof(x), "vma", ()))


def _manual_axis_type(aval: Any) -> Any:
    """``aval.manual_axis_type``, its documented name since jax 0.10.0 (``.mat`` is an alias)."""
    mat = getattr(aval, "manual_axis_type", None)
    return mat if mat is not None else getattr(aval, "mat", None)


@overload
def vary_like(value: None, *others: ArrayLike) -> None: ...
@overload
def vary_like(value: jax.Array, *others: ArrayLike) -> jax.Array: ...
def vary_like(value: jax.Array | None, *others: ArrayLike) -> jax.Array | None:
    """``value`` made to vary over every mesh axis that one of ``others`` varies over.

    A custom_vjp's backward must return each cotangent with its primal's type. Inside
    ``shard_map`` a replicated norm scale meets activations that vary per rank, and its
    gradient (a sum over this rank's rows) varies too; casting the scale to varying first
    makes that the primal's type, and the cast's own transpose sums the gradient over the
    ranks, as the gradient of a replicated parameter must be. Outside ``shard_map`` it
    returns ``value`` unchanged. Public as ``rudax.sharding.vary_like``.

    Args:
      value: an array (or None, returned as is).
      *others: the arrays whose varying mesh axes ``value`` must cover.

    Returns:
      ``value``, cast to varying over the axes it lacked.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> import rudax.sharding as rs
      >>> mesh = jax.sharding.Mesh(jax.devices(), ("data",))
      >>> def f(w, x):
      ...     print(sorted(rs.varying_axes(w)), sorted(rs.varying_axes(rs.vary_like(w, x))))
      ...     return x
      >>> y = jax.shard_map(f, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"))(
      ...     jnp.ones(3), jnp.ones((jax.device_count(), 3)))
      [] ['data']
    """
    if value is None:
        return value
    missing = frozenset().union(*(varying_axes(o) for o in others)) - varying_axes(value)
    if not missing:
        return value
    return jax.lax.pcast(value, tuple(sorted(missing)), to="varying")


def vary_over_mesh(value: jax.Array) -> jax.Array:
    """``value`` made to vary over every manual mesh axis of the enclosing ``shard_map``.

    An FSDP shard varies over its own axis only; a weight gathered from it is then typed
    invariant over the mesh's other axes (``data``), and the transpose of that invariance sums
    the weight's gradient over them: an all-reduce of the full gradient, before the
    reduce-scatter cuts it. Cast to varying first, the gradient is reduce-scattered first and
    only the shard is summed over the other axes (``benchmarks/fsdp_comm.py``: 5.6x fewer
    bytes on ``data=2,fsdp=4``). Unchanged outside ``shard_map`` and without ``check_vma``
    (nothing is tracked there).
    """
    current = varying_axes(value)
    if not current:
        return value
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
    missing = frozenset(manual) - current
    if not missing:
        return value
    return jax.lax.pcast(value, tuple(sorted(missing, key=str)), to="varying")
