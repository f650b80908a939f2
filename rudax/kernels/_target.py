"""The GPU a computation is lowered for: named (``gpu_export_target``, for an export from a
host without one) and read (``target_gpu``, what ``impl="auto"``'s table and the tuned
blocks are looked up by, ``rudax.kernels._auto``), and whether JAX's backends have started.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

__all__ = ["backends_are_initialized", "gpu_export_target", "target_gpu"]


@contextlib.contextmanager
def gpu_export_target(device_kind: str = "NVIDIA H100") -> Iterator[None]:
    """Within it, a computation is lowered for ``device_kind`` even on a host without a GPU.

    jax 0.11's Triton lowering reads the target GPU's compute capability from the default
    device, or, when that is not a GPU (a CPU host exporting for CUDA), from the abstract
    mesh's abstract device; without one it raises "No supported GPU devices found". jax
    0.10.2 lowers without it. This sets a one-device abstract mesh whose device is the GPU
    named: ``jax.sharding.AbstractDevice`` and ``use_abstract_mesh``, public in both. Its
    ``device_kind`` must be one Pallas knows (``jax._src.pallas.triton.gpu_info``: "NVIDIA
    H100", "NVIDIA H200", "NVIDIA A100", ...). A ``shard_map`` over a concrete mesh inside it
    is not what it is for: export one device's computation.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import rudax.kernels as rk
      >>> x = jax.ShapeDtypeStruct((4, 64), jnp.bfloat16)
      >>> with rk.gpu_export_target("NVIDIA H100"):
      ...     exported = jax.export.export(
      ...         jax.jit(lambda x: rk.rms_norm(x, jnp.ones(64))),
      ...         platforms=["cuda", "cpu"],
      ...         disabled_checks=rk.EXPORT_DISABLED_CHECKS,
      ...     )(x)
      >>> exported.platforms
      ('cuda', 'cpu')
    """
    if not isinstance(device_kind, str) or not device_kind:
        raise ValueError(f"device_kind must be a GPU's device kind, got {device_kind=}")
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("rudax_gpu_target",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def backends_are_initialized() -> bool:
    """Whether JAX has started a backend (after which XLA_FLAGS is no longer read).

    ``jax._src.xla_bridge.backends_are_initialized``: private, present in jax 0.10.2 and
    0.11; if a release drops it, the answer is taken as False.
    """
    try:
        from jax._src import xla_bridge
    except ImportError:
        return False
    check = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(check()) if check is not None else False


def target_gpu() -> tuple[str, str | None] | None:
    """``(device_kind, compute capability)`` of the GPU being lowered for, or None.

    Inside ``gpu_export_target`` its abstract device (no capability known); else the first
    local GPU, asked only once JAX has started its backends (asking would start them, after
    which ``XLA_FLAGS`` is no longer read).
    """
    # getattr: an empty mesh's device is None; a jax without the field, no target named
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None and device.platform in ("cuda", "gpu"):
        return device.device_kind, None
    if backends_are_initialized():
        for d in jax.devices():
            if d.platform == "gpu":
                return d.device_kind, getattr(d, "compute_capability", None)
    return None
