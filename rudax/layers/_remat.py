"""Activation checkpointing (rematerialization) with named policies, over ``nnx.remat``.

The backward of a block needs its forward's intermediate values. Without remat every one is
kept from the forward until the backward uses it; with it only the block's inputs (and what
the policy names) are kept, and the rest is computed again inside the backward. Memory for
activations drops from "every intermediate of every block" to "each block's input plus one
block's intermediates", for about one more forward pass of compute (``"full"``).

The policies, the names MaxText and Levanter use:

=========================== ============================================================
``"none"``                  no checkpointing: ``f`` itself.
``"full"``                  keep only the inputs; recompute everything (``policy=None``).
``"dots_saveable"``         keep every matmul's output (``dot_general``), recompute the
                            elementwise work between them.
``"dots_with_no_batch_dims"`` keep the outputs of matmuls with no batch dimension (the
                            ``x @ W`` projections), recompute attention's batched
                            ``q @ k`` and ``p @ v`` and the elementwise work.
``"offload"``               as ``"dots_with_no_batch_dims"``, but the kept outputs are
                            moved to pinned host memory during the forward and back for the
                            backward: device memory of ``"full"``, less recompute, paid in
                            host transfers. Needs a backend with a ``pinned_host`` memory.
=========================== ============================================================

Gradients are the same function of the same inputs under every policy; XLA may fuse the
recomputed forward differently from the original, so they agree bitwise where it keeps the
order of every sum, and otherwise to rounding (``tests/layers/test_remat.py`` checks both).

Where it pays: a block under ``lax.scan`` (the backward is a loop that recomputes one block
per iteration). An *unrolled* Python loop of checkpointed blocks gains nothing on XLA:CPU
(jax 0.10.2): the compiled program has dropped the ``optimization_barrier``s that
``prevent_cse`` adds and merged the recomputation into the forward, so its temporary bytes
are the plain program's, or nearly (to the byte for blocks of plain ``jnp``; 7-12% fewer for
rudax's and the GPT's blocks, against 67% fewer for the trainer's 4-block GPT under a scan
and 87% for 16 blocks: ``tests/layers/test_remat.py`` and ``benchmarks/remat.py``). How
XLA:GPU treats the unrolled case is measured by ``benchmarks/remat.py`` on a GPU
(``benchmarks/gpu_check.sh``'s remat stage).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
from flax import nnx

Policy = Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims", "offload"]
REMAT_POLICIES: tuple[str, ...] = (
    "none",
    "full",
    "dots_saveable",
    "dots_with_no_batch_dims",
    "offload",
)


def check_policy(policy: str) -> None:
    """ValueError for a name that is not one of ``REMAT_POLICIES``."""
    if policy not in REMAT_POLICIES:
        raise ValueError(f"policy must be one of {REMAT_POLICIES}, got {policy=}")


def _offload_policy() -> Callable[..., Any]:
    kinds = [m.kind for m in jax.local_devices()[0].addressable_memories()]
    if "pinned_host" not in kinds:
        raise ValueError(
            f'policy="offload" keeps matmul outputs in pinned host memory, which the '
            f"{jax.default_backend()} backend does not have (its memories: {kinds}); use "
            '"dots_with_no_batch_dims" to keep them on the device or "full" to recompute them'
        )
    return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")


def _jax_policy(policy: str) -> Callable[..., Any] | None:
    if policy == "full":
        return None  # jax.checkpoint's default: nothing saveable but the inputs
    if policy == "dots_saveable":
        return jax.checkpoint_policies.dots_saveable
    if policy == "dots_with_no_batch_dims":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return _offload_policy()


def remat(
    f: Callable[..., Any],
    *,
    policy: Policy = "full",
    prevent_cse: bool = True,
    static_argnums: int | tuple[int, ...] = (),
) -> Callable[..., Any]:
    """``f`` under activation checkpointing with a named ``policy`` (see the module docstring).

    ``f`` is a function whose arguments may be ``nnx.Module``s (``nnx.remat``'s rule), or an
    ``nnx.Module``, whose ``__call__`` is checkpointed: ``remat(block)(x)`` is ``block(x)``
    with ``block``'s intermediates recomputed in the backward. Keyword arguments are passed
    through as traced values (pytrees; None is fine).

    Args:
      f: the function or module to checkpoint.
      policy: one of ``REMAT_POLICIES``; ``"none"`` returns ``f`` unchanged.
      prevent_cse: ``jax.checkpoint``'s: keeps XLA from merging the recomputation with the
        forward (which would undo it). False is safe, and faster, under ``lax.scan``.
      static_argnums: ``jax.checkpoint``'s, positions of a function ``f``'s arguments (not
        for a module).

    Returns:
      A callable with ``f``'s signature and results.

    Raises:
      ValueError: an unknown policy, or ``"offload"`` on a backend without pinned host
        memory.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import rudax.layers as rl
      >>> mlp = rl.GatedMLP(8, 16, rngs=nnx.Rngs(0))
      >>> x = jnp.ones((2, 8))
      >>> loss = lambda m: rl.remat(m, policy="full")(x).sum()
      >>> plain = lambda m: m(x).sum()
      >>> g, h = nnx.grad(loss)(mlp), nnx.grad(plain)(mlp)
      >>> bool(jax.tree.all(jax.tree.map(jnp.allclose, g, h)))
      True

    References:
      Chen et al., `Training Deep Nets with Sublinear Memory Cost
      <https://arxiv.org/abs/1604.06174>`_, 2016; ``jax.checkpoint`` and
      ``jax.checkpoint_policies``.
    """
    check_policy(policy)
    if policy == "none":
        return f
    jax_policy = _jax_policy(policy)
    # nnx.remat binds keyword arguments to positions and refuses those it cannot: they travel
    # as one dict after the positional arguments, so static_argnums still counts f's own.
    if isinstance(f, nnx.Module):
        # The module is an argument of the checkpointed function, not a closure: nnx then
        # carries its variables in and out (and their gradients) like any other input.
        module = f
        call = nnx.remat(
            lambda m, *args: m(*args[:-1], **args[-1]), policy=jax_policy, prevent_cse=prevent_cse
        )
        return lambda *args, **kwargs: call(module, *args, kwargs)
    call = nnx.remat(
        lambda *args: f(*args[:-1], **args[-1]),
        policy=jax_policy,
        prevent_cse=prevent_cse,
        static_argnums=static_argnums,
    )
    return functools.wraps(f)(lambda *args, **kwargs: call(*args, kwargs))
