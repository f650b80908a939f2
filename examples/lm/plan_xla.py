"""XLA's own accounting of a planned run's steps: ``python -m examples.lm.plan --xla``.

The trainer's (or the fine-tuning program's) jitted steps are compiled for this process's
backend on abstract inputs placed as the run places them, and ``compiled.memory_analysis()``
is read. Nothing is allocated, so a 7B step compiles on a laptop's CPU in about a minute
(with ``--scan-layers``, one decoder layer is compiled). On a GPU machine the numbers are the
GPU's; anywhere else they are XLA:CPU's, whose fusion and buffer assignment differ from a
GPU's: a cross-check of the plan there, not the target's figure.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import rudax.layers as rl
import rudax.models as rm
import rudax.sharding as rs
from examples.lm import plan as pl
from examples.lm.step import make_optimizer


class StepMemory(NamedTuple):
    """One compiled step's bytes per device, as XLA reports them."""

    arguments: int
    outputs: int
    aliased: int  # outputs written into donated arguments' buffers
    temporaries: int

    @property
    def added(self) -> int:
        """What the step holds beyond its arguments (the run's resident state)."""
        return self.outputs - self.aliased + self.temporaries


def _memory(compiled: Any) -> StepMemory:
    m = compiled.memory_analysis()
    return StepMemory(
        m.argument_size_in_bytes,
        m.output_size_in_bytes,
        m.alias_size_in_bytes,
        m.temp_size_in_bytes,
    )


def _abstract(tree: Any, shardings: Any = None) -> Any:
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def compiled_steps(args: argparse.Namespace) -> tuple[str, dict[str, StepMemory]]:
    """The backend's name and ``{"microbatch": ..., "update": ...}`` for the plan's flags."""
    spec = pl.model_of(args)
    pl.progress("tracing the run's steps to compile them (--xla)...")
    if args.finetune != "none":
        model = nnx.eval_shape(lambda: pl.finetune_model(args, spec))
        model.eval()
        eval_def = nnx.graphdef(model)
        model.train()
        graphdef, adapters, rngs, base = nnx.split(model, rl.LoRAParam, nnx.RngState, ...)
        tx = pl.finetune_optimizer()
        opt_state, acc = pl.optimizer_state(tx, adapters)
        run = rs.make_train_steps(graphdef, tx, rm.causal_lm_loss_sum, eval_graphdef=eval_def)
        shape = (args.batch_size, spec.seq_len)
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in pl.FINETUNE_BATCH}
        adapters, rngs, base = _abstract(adapters), _abstract(rngs), _abstract(base)
        steps = {
            "microbatch": run.micro.lower(adapters, rngs, _abstract(acc), base, batch),
            "update": run.apply.lower(adapters, _abstract(opt_state), _abstract(acc)),
        }
        platform = jax.devices()[0].platform
    else:
        mesh = pl.trace_mesh(args.mesh) if args.mesh else None
        model = pl.trained_model(spec, mesh)
        graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        tx = make_optimizer(args, mesh)
        opt_state, acc = pl.optimizer_state(tx, params)
        place = (lambda t: _abstract(t, rs.state_shardings(t, mesh))) if mesh else _abstract
        params, opt_state, acc = place(params), place(opt_state), place(acc)
        batch_sharding = rs.batch_sharding(mesh) if mesh else None
        batch = jax.ShapeDtypeStruct(
            (args.batch_size, spec.seq_len + 1), jnp.int32, sharding=batch_sharding
        )
        loss = functools.partial(rm.next_token_loss_sum, chunk=spec.loss_chunk)
        run = rs.make_train_steps(graphdef, tx, loss, mesh=mesh, donate=True)
        rngs, rest = place(rngs), place(rest)
        steps = {
            "microbatch": run.micro.lower(params, rngs, acc, rest, batch),
            "update": run.apply.lower(params, opt_state, acc),
        }
        platform = (mesh.devices.flat[0] if mesh else jax.devices()[0]).platform
    compiled = {}
    for name, lowered in steps.items():
        pl.progress(f"compiling the {name} step for {platform} (--xla)...")
        compiled[name] = _memory(lowered.compile())
    return platform, compiled


def format_xla(plan: pl.Plan, platform: str, steps: dict[str, StepMemory]) -> str:
    """XLA's peaks beside the plan's, in GB per device."""
    planned = {"microbatch": plan.micro_peak, "update": plan.apply_peak}
    lines = [f"XLA:{platform.upper()} memory_analysis (resident + outputs - aliased + temp)"]
    for name, m in steps.items():
        peak = plan.resident + m.added
        lines.append(
            f"  {name:<14}{peak / pl.GB:>10.3f} GB  (temp {m.temporaries / pl.GB:.3f}; "
            f"the plan's {planned[name] / pl.GB:.3f}, x{planned[name] / peak:.2f})"
        )
    return "\n".join(lines)
