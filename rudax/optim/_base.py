"""A transform's ``(init, update)`` pair, typed as rudax's transforms behave.

optax types every ``update`` as taking any state (``optax.TransformUpdateFn``: ``state:
OptState``, any pytree), while each update here takes the one state its own ``init`` built
(a ``ScaleByTorchAdamState``, say) and reads its fields. Annotated with that state, the
update is not an ``optax.TransformUpdateFn`` to a type checker, though it is one for every
state its transform can be given. ``transformation`` and ``transformation_with_extra_args``
state the pairing instead: ``init`` returns the state type ``update`` takes and returns,
which pyright and mypy check at each call, and the conversion to optax's looser protocol is
made once, here.

``safe_increment`` is ``optax.safe_increment`` annotated as it behaves on a count array: optax
types it ``ArrayLike -> ArrayLike``, so its result could not fill a ``count: jax.Array`` field
or be ``.astype``-ed without a check at every call.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, cast

import jax
import jax.numpy as jnp
import optax

# Any optax state; a NamedTuple of arrays and pytrees is one (an Iterable[ArrayTree]).
State = TypeVar("State", bound=optax.OptState)
State_co = TypeVar("State_co", bound=optax.OptState, covariant=True)


class InitFn(Protocol[State_co]):
    """An ``init``: the parameters to the transform's initial state."""

    def __call__(self, params: Any) -> State_co: ...


class UpdateFn(Protocol[State]):
    """An ``update`` that takes and returns the state type its ``init`` builds."""

    def __call__(self, updates: Any, state: State, params: Any = None) -> tuple[Any, State]: ...


class UpdateFnWithExtraArgs(Protocol[State]):
    """``UpdateFn`` with extra keyword arguments (``optax.TransformUpdateExtraArgsFn``)."""

    def __call__(
        self, updates: Any, state: State, params: Any = None, **extra_args: Any
    ) -> tuple[Any, State]: ...


def transformation(init: InitFn[State], update: UpdateFn[State]) -> optax.GradientTransformation:
    """``optax.GradientTransformation(init, update)``, with ``update`` taking ``init``'s state."""
    # The one conversion to optax's protocol (see the module docstring): nothing changes at
    # run time, the function is passed as it is.
    return optax.GradientTransformation(init, cast(optax.TransformUpdateFn, update))


def transformation_with_extra_args(
    init: InitFn[State], update: UpdateFnWithExtraArgs[State]
) -> optax.GradientTransformationExtraArgs:
    """``optax.GradientTransformationExtraArgs(init, update)``, typed as ``transformation``."""
    return optax.GradientTransformationExtraArgs(
        init, cast(optax.TransformUpdateExtraArgsFn, update)
    )


def safe_increment(count: jax.Array) -> jax.Array:
    """``optax.safe_increment(count)``: count + 1, saturating at its dtype's maximum.

    ``jnp.asarray`` of the array optax returns is that array (no copy, no operation in a
    traced program); it only tells the type checker so.
    """
    return jnp.asarray(optax.safe_increment(count))
