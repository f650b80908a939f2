"""``make_train_steps``: the jitted steps of a training program, on one device or over a mesh.

One update, as data flows through it (``ARCHITECTURE.md``)::

    for each of the window's microbatches:              micro(trained, rngs, acc, rest, batch)
        loss_sum, grads = value_and_grad(loss)(model)     a SUM over the counted tokens
        acc = acc.add(grads, weight=tokens)               (rudax.optim.GradientAccumulator)
    grads, acc = acc.pop(normalize=True)                apply(trained, opt_state, acc)
    trained, opt_state = update_and_apply(tx, grads, ...)  tx.update, optax.apply_updates
                                                        (fused_adamw: one pass, in place)

The model is ``nnx.split(model, wrt, nnx.RngState, ...)``: what is trained (``nnx.Param``
for a whole model, ``rudax.layers.LoRAParam`` for adapters), the RNG state (dropout; empty
for a model without it) and the rest (a frozen base, buffers), so pretraining, fine-tuning
and post-training share one step and differ only in their ``loss``.

Over a mesh only the loss changes: it runs inside ``jax.shard_map``, each device on its
slice of the batch, and returns one loss sum per device; ``jax.grad`` of their total
differentiates through the shard_map. Parameters sharded over ``fsdp`` (``ShardedParameter``
storage, ``rudax.models.shard``) get their gradients reduce-scattered by the all-gather's
transpose; parameters replicated over ``data`` get theirs summed over ``data`` by the
transpose of the replication. So the gradients that come out are sums over the whole global
batch, sharded like the parameters, and ``tx.update`` runs outside the shard_map, where the
global gradient norm is the norm of the global arrays. Dropout draws its masks per device
(the RNG keys folded with the device's place in the mesh), and every device's RNG counts
advance alike, so the RNG state stays replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from rudax.optim import ClipByGlobalNormState, FusedAdamWState, update_and_apply
from rudax.sharding._mesh import state_shardings

__all__ = ["TrainSteps", "make_train_steps"]

# loss(model, batch) -> (loss_sum, metrics); metrics["tokens"] weighs the microbatch.
Loss = Callable[[Any, Any], tuple[jax.Array, dict[str, jax.Array]]]


class TrainSteps(NamedTuple):
    """The jitted functions of a run; each compiles once for the run's shapes.

    ``trained``, ``rngs`` and ``rest`` are the three states of ``nnx.split(model, wrt,
    nnx.RngState, ...)``; ``acc`` a ``rudax.optim.GradientAccumulator`` of ``trained``.
    """

    micro: Callable  # (trained, rngs, acc, rest, batch) -> (acc, rngs, metrics)
    apply: Callable  # (trained, opt_state, acc) -> (trained, opt_state, acc, grad_norm)
    evaluate: Callable  # (trained, rngs, rest, batch) -> metrics; no gradient, eval_graphdef
    forward: Callable  # (trained, rngs, rest, batch) -> loss_sum (a profiler's phases)
    gradients: Callable  # (trained, rngs, rest, batch) -> grads


def make_train_steps(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    loss: Loss,
    *,
    mesh: Mesh | None = None,
    eval_graphdef: nnx.GraphDef | None = None,
    donate: bool = False,
    mean_metrics: Sequence[str] = ("aux_loss",),
) -> TrainSteps:
    """The steps of a run training ``nnx.merge(graphdef, trained, rngs, rest)`` by ``loss``.

    Args:
      graphdef: the model's structure, from ``nnx.split(model, wrt, nnx.RngState, ...)``.
      tx: the optimizer of ``trained``.
      loss: ``loss(model, batch) -> (loss_sum, metrics)``. The loss is a SUM over the
        microbatch's counted tokens and ``metrics["tokens"]`` their count: the window's
        gradient is then the mean over all its tokens, however they fall into microbatches
        and devices (``GradientAccumulator``'s token weighting).
      mesh: None for one device; else a mesh with axes ``data`` and/or ``fsdp``
        (``rudax.sharding.make_mesh``), the model already sharded over ``fsdp`` if the mesh
        has that axis, the state placed by ``rudax.sharding.place`` and each batch by
        ``put_batch``.
      eval_graphdef: the structure ``evaluate`` merges into, e.g. the model after
        ``model.eval()`` (dropout off); default ``graphdef``.
      donate: whether ``micro`` donates its ``acc`` and ``apply`` its ``(trained,
        opt_state, acc)``: their buffers are reused for the outputs, so a step holds the
        training state once, not twice. A donated argument is deleted by the call: a caller
        that calls a step again on the same inputs (timing it) passes False.
      mean_metrics: the metrics averaged over devices; every other one is summed.
        ``rudax.models.causal_lm_loss_sum``'s ``aux_loss`` (a Mixtral's balancing loss) is
        each device's mean.

    Returns:
      ``TrainSteps``. ``micro``'s metrics add ``loss_sum``, what is differentiated.
      ``apply``'s ``grad_norm`` is the global norm of the window's gradient before clipping
      (read from the clipping's state where ``tx`` clips, so it is not computed twice).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> import rudax.optim as ro
      >>> from rudax.sharding import make_train_steps
      >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> def loss(m, batch):
      ...     err = m(batch["x"])[:, 0] - batch["y"]
      ...     return jnp.sum(err**2), {"tokens": jnp.int32(err.size)}
      >>> graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
      >>> tx = optax.sgd(0.1)
      >>> steps = make_train_steps(graphdef, tx, loss)
      >>> acc = ro.GradientAccumulator.init(params)
      >>> batch = {"x": jnp.ones((4, 2)), "y": jnp.zeros(4)}
      >>> acc, rngs, metrics = steps.micro(params, rngs, acc, rest, batch)
      >>> params, opt_state, acc, norm = steps.apply(params, tx.init(params), acc)
      >>> int(metrics["tokens"])
      4
    """
    eval_graphdef = graphdef if eval_graphdef is None else eval_graphdef
    means = frozenset(mean_metrics)

    def local(definition: nnx.GraphDef) -> Callable:
        def run(trained: Any, rngs: Any, rest: Any, batch: Any) -> Any:
            # copy=True: Variables of this trace. The states' own were made by the jit or
            # shard_map around the gradient, and dropout's RNG counts cannot be mutated
            # from this (inner) trace level.
            model = nnx.merge(definition, trained, rngs, rest, copy=True)
            loss_sum, metrics = loss(model, batch)
            return loss_sum, (metrics, nnx.state(model, nnx.RngState))

        return run

    def objective(definition: nnx.GraphDef) -> Callable:
        if mesh is None:
            return local(definition)
        return _over_mesh(local(definition), mesh, means)

    train_objective, eval_objective = objective(graphdef), objective(eval_graphdef)

    def constrain(tree: Any) -> Any:
        if mesh is None:
            return tree
        return jax.lax.with_sharding_constraint(tree, state_shardings(tree, mesh))

    def micro(trained, rngs, acc, rest, batch):
        grad = jax.value_and_grad(train_objective, has_aux=True)
        (loss_sum, (metrics, rngs)), grads = grad(trained, rngs, rest, batch)
        return acc.add(grads, weight=metrics["tokens"]), rngs, {"loss_sum": loss_sum, **metrics}

    def apply(trained, opt_state, acc):
        grads, acc = acc.pop(normalize=True)  # the mean over the window's counted tokens
        # update then apply_updates; for fused_adamw one pass that writes the parameters
        trained, opt_state = update_and_apply(tx, grads, opt_state, trained)
        # Fresh zeros (the emptied accumulator, new state) would come out replicated, and the
        # next call would compile again for them: pin everything where the inputs live.
        trained, opt_state, acc = constrain((trained, opt_state, acc))
        return trained, opt_state, acc, _grad_norm(grads, opt_state)

    def evaluate(trained, rngs, rest, batch):
        return eval_objective(trained, rngs, rest, batch)[1][0]

    def forward(trained, rngs, rest, batch):
        return train_objective(trained, rngs, rest, batch)[0]

    return TrainSteps(
        micro=jax.jit(micro, donate_argnums=(2,) if donate else ()),
        apply=jax.jit(apply, donate_argnums=(0, 1, 2) if donate else ()),
        evaluate=jax.jit(evaluate),
        forward=jax.jit(forward),
        gradients=jax.jit(jax.grad(forward)),
    )


def _over_mesh(local: Callable, mesh: Mesh, means: frozenset[str]) -> Callable:
    """``local`` inside ``jax.shard_map``: each device on its rows, the results combined."""
    axes = tuple(mesh.axis_names)
    per_device = P(axes)

    def device_index() -> jax.Array:
        index = jnp.int32(0)
        for name in axes:  # row-major over the mesh, as the batch's rows are split
            index = index * mesh.shape[name] + jax.lax.axis_index(name)
        return index

    def own_keys(rngs: Any) -> Any:
        # a key per device: each device's rows get dropout masks of their own
        index = device_index()
        return jax.tree.map(
            lambda v: (
                v.replace(jax.random.fold_in(v.get_value(), index))
                if isinstance(v, nnx.RngKey)
                else v
            ),
            rngs,
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )

    def ranked(trained: Any, rngs: Any, rest: Any, batch: Any) -> Any:
        loss_sum, (metrics, after) = local(trained, own_keys(rngs), rest, batch)
        # the counts advanced alike on every device; the keys go back as they came
        after = jax.tree.map(
            lambda new, old: old if isinstance(old, nnx.RngKey) else new,
            after,
            rngs,
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )
        return jax.tree.map(lambda x: x[None], (loss_sum, metrics)), after

    def run(trained: Any, rngs: Any, rest: Any, batch: Any) -> Any:
        specs = lambda tree: jax.tree.map(lambda s: s.spec, state_shardings(tree, mesh))
        (loss_sum, metrics), rngs = jax.shard_map(
            ranked,
            mesh=mesh,
            in_specs=(specs(trained), P(), specs(rest), per_device),
            out_specs=(per_device, P()),
        )(trained, rngs, rest, batch)
        combined = {k: jnp.mean(v) if k in means else jnp.sum(v) for k, v in metrics.items()}
        return jnp.sum(loss_sum), (combined, rngs)

    return run


def _grad_norm(grads: Any, opt_state: Any) -> jax.Array:
    """The window's pre-clip global gradient norm: the clipping's (``rudax.optim``'s
    ``clip_by_global_norm`` or ``fused_adamw``), which computed it already, else its own."""
    kinds = (ClipByGlobalNormState, FusedAdamWState)
    found = jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, kinds))
    found = [s for s in found if isinstance(s, kinds)]
    return found[0].global_norm if found else optax.tree.norm(grads)
