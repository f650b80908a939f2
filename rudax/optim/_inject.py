"""``optax.inject_hyperparams`` for rudax's optimizers: structural arguments static, floats fp32.

``optax.inject_hyperparams(factory)`` moves every numeric argument of ``factory`` into the
optimizer state, where it can be read and changed between updates without recompiling. Two
of its defaults do not fit an optimizer that follows torch:

* an int argument becomes an array, and a callable a schedule. Muon's ``ns_steps`` (a loop
  count) and L-BFGS's ``history_size`` (a buffer length) shape the program, and ``mask=`` is
  a callable of the parameters, not a schedule: each factory declares these with
  ``static_arguments`` and ``inject_hyperparams`` passes them as optax's ``static_args``;
* hyperparameters are cast to the parameters' dtype, so with bf16 parameters ``b2=0.999``
  becomes 1.0. Here they are float32 unless ``hyperparam_dtype`` says otherwise.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

Factory = TypeVar("Factory", bound=Callable[..., Any])

_ATTRIBUTE = "__rudax_static_args__"
_ZERO_ATTRIBUTE = "__rudax_static_when_zero__"


def static_arguments(*names: str, when_zero: tuple[str, ...] = ()) -> Callable[[Factory], Factory]:
    """Declares which arguments of an optimizer factory shape its program (never injected).

    ``when_zero`` names the coefficients whose zero leaves a buffer out of the state (SGD's
    and RMSprop's momentum): given as the number 0 they are static too, so the injected state
    has the plain one's layout even when ``init`` runs under ``jax.jit``, where an injected 0
    is a tracer nobody can read.
    """

    def declare(factory: Factory) -> Factory:
        setattr(factory, _ATTRIBUTE, names)
        setattr(factory, _ZERO_ATTRIBUTE, when_zero)
        return factory

    return declare


def declared_static_arguments(factory: Callable[..., Any]) -> tuple[str, ...]:
    """The arguments ``factory`` declared with ``static_arguments`` (none if it did not)."""
    return tuple(getattr(factory, _ATTRIBUTE, ()))


def _static_when_zero(factory: Callable[..., Any]) -> tuple[str, ...]:
    """The arguments ``factory`` declared static when given as the number 0 (``when_zero``)."""
    return tuple(getattr(factory, _ZERO_ATTRIBUTE, ()))


def inject_hyperparams(
    factory: Callable[..., optax.GradientTransformation],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: DTypeLike | None = jnp.float32,
) -> Callable[..., optax.GradientTransformationExtraArgs]:
    """``optax.inject_hyperparams`` that keeps structural arguments static and floats in fp32.

    The wrapped factory takes the same arguments as ``factory``; each float hyperparameter
    (the learning rate, betas, eps, weight decay, momentum, ...) given as a number or a
    schedule is kept in ``state.hyperparams`` as a float32 scalar, to read or set between
    updates (``state.hyperparams["learning_rate"] = ...``) without recompiling the update.
    The arguments ``factory`` declares structural (``ns_steps``, ``history_size``,
    ``moment_dtype``, ``mask``, ...) and those in ``static_args`` are passed as given, and so
    is a momentum given as 0 (SGD, RMSprop): it decides that the state has no buffer, as in
    the plain optimizer, so it cannot be changed later; give it non-zero to inject it.

    It differs from ``optax.inject_hyperparams`` only in those two defaults: optax casts
    hyperparameters to the parameters' dtype (``hyperparam_dtype=None``), which rounds
    ``b2=0.999`` to 1.0 for bf16 parameters, and injects every int. For a factory that
    declares nothing (an optax one, say) this is ``optax.inject_hyperparams(factory,
    static_args, hyperparam_dtype=jnp.float32)``.

    Args:
      factory: an optimizer factory, e.g. ``rudax.optim.adamw``.
      static_args: further argument names to pass as given (optax's ``static_args``).
      hyperparam_dtype: the dtype of the injected float hyperparameters; None casts them to
        the parameters' dtype, as optax does.

    Returns:
      A callable with ``factory``'s arguments that returns an
      ``optax.GradientTransformationExtraArgs`` whose state is optax's
      ``InjectHyperparamsState`` (``.hyperparams``, ``.inner_state``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.ones((2,), jnp.bfloat16)}
      >>> tx = ro.inject_hyperparams(ro.adamw)(learning_rate=1e-3)
      >>> state = tx.init(params)
      >>> state.hyperparams["b2"]  # not rounded to bf16's 1.0
      Array(0.999, dtype=float32)
      >>> state.hyperparams["learning_rate"] = jnp.asarray(5e-4)  # no recompilation
      >>> updates, state = jax.jit(tx.update)({"w": jnp.ones((2,), jnp.bfloat16)}, state, params)
    """
    names = {static_args} if isinstance(static_args, str) else set(static_args)
    names |= set(declared_static_arguments(factory))
    # optax annotates a dtype instance; jnp.float32 is a scalar type, the same dtype to it.
    dtype = None if hyperparam_dtype is None else jnp.dtype(hyperparam_dtype)
    zero_static = _static_when_zero(factory)
    if not zero_static:
        return optax.inject_hyperparams(
            factory, static_args=tuple(sorted(names)), hyperparam_dtype=dtype
        )
    signature = inspect.signature(factory)

    @functools.wraps(factory)
    def wrapped(*args: Any, **kwargs: Any) -> optax.GradientTransformationExtraArgs:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        zeros = {
            n
            for n in zero_static
            if isinstance(bound.arguments[n], numbers.Real) and bound.arguments[n] == 0
        }
        inject = optax.inject_hyperparams(
            factory, static_args=tuple(sorted(names | zeros)), hyperparam_dtype=dtype
        )
        return inject(*args, **kwargs)

    return wrapped


def check_not_injected(owner: str, values: dict[str, Any]) -> None:
    """A TypeError for a structural argument that arrives as an array, naming the fix.

    ``optax.inject_hyperparams`` makes every int argument an array and takes every callable
    (a dtype, a mask function) for a schedule, whose value is an array too. A loop count, a
    buffer length or a dtype fixes the compiled program and cannot be one.
    """
    for name, value in values.items():
        if isinstance(value, jax.Array):
            raise TypeError(
                f"{owner}: {name} shapes the compiled program and cannot be an array or a "
                f"traced value, got {name}={value!r}. optax.inject_hyperparams makes int "
                f"arguments arrays and callables (dtypes, masks) schedules: pass "
                f"static_args=({name!r}, ...) to it, or use rudax.optim.inject_hyperparams, "
                f"which keeps {owner}'s structural arguments static"
            )
