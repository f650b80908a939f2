"""Per-device memory of a training run, worked out before it is launched.

    python -m examples.lm.plan --mesh fsdp=8 --optimizer adamw --device-memory 141 \\
        --hf-config llama-7b/config.json --seq-len 4096 --batch-size 8 --remat full
    python -m examples.lm.plan --finetune qlora --hf-config llama-70b/config.json \\
        --seq-len 2048 --batch-size 1 --remat full --device-memory 141

With ``--xla`` it also compiles the run's real steps for this machine's backend and prints
XLA's own ``memory_analysis`` beside the plan (``examples/lm/plan_xla.py``): on a GPU machine,
the target's figure.

It takes the trainer's own flags (``examples.lm.train``'s: the model, ``--mesh``, dtypes,
``--optimizer``, ``--remat``, ``--scan-layers``, ``--batch-size``; what the trainer refuses,
it refuses), or with ``--finetune lora|qlora`` those of ``examples.finetune`` (adapters on
every projection, AdamW on them), and prints the bytes each device holds: parameters, fp32
masters, optimizer moments, accumulator, and what each step adds to them. The model is the
trainer's ``rudax.models.ModelSpec`` (a ``rudax.models.LlamaForCausalLM``), of the flags
or of ``--hf-config``. Nothing is allocated and nothing compiled: the model, the optimizer
state and the accumulator are built abstractly (``nnx.eval_shape``, ``jax.eval_shape``): on
a 2-core CPU a 7B plan takes seconds, a 70B QLoRA one under a minute with ``--scan-layers``
and two without (80 layers traced); each phase prints a line on stderr as it starts.
``examples/lm/hf_configs/`` holds the ``config.json`` of Llama 2 7B and Llama 3.1 8B and 70B.

Where the numbers come from:

- The state (parameters, masters, moments, accumulator) is the shapes and dtypes of the
  trainer's own ``tx.init`` and ``GradientAccumulator.init``, per device as
  ``examples.lm.step.placement`` lays them out: over ``fsdp`` every leaf is
  ``ceil(size / fsdp)`` elements (``rudax.sharding.ShardedParameter``'s padding), else whole.
- The activations are what JAX's reverse mode keeps for the backward of one microbatch on one
  device: the residuals of ``jax.vjp`` of the run's own loss (``saved_for_backward``; over a
  mesh, the trainer's shard_map'd loss, FSDP gathers included), traced, not guessed, so each
  remat policy counts what it really keeps. With ``--scan-layers`` the layers are stored
  stacked and the scan reads them as stored: their parameters are the step's inputs, not
  residuals (no second copy of a QLoRA's NF4 base). They are counted as XLA stores them
  (``kept_for_backward``): a residual the backward never reads is dead code (the fp32
  gradient of a frozen table, which the fused loss forms in its forward; dropout's zeros), a
  residual kept in several shapes is one buffer (a reshape is a bitcast), and a dropout mask
  costs 8 bytes an element, threefry's two uint32 halves, not 1.
- What XLA keeps besides (``kept by XLA``), when the layers are neither scanned nor
  rematerialized, so that forward and backward are one straight-line program whose common
  subexpressions XLA merges: every NF4 weight dequantized to the compute dtype
  (``nf4_matmul``'s backward dequantizes it again; the forward's copy lives until then, one
  dense copy of the whole base); each MLP's ``sigmoid(gate)`` and ``gate * sigmoid(gate)``
  (``silu_mul``'s backward recomputes them); a LoRA'd gate or up projection's output as its
  two summands (the sum is fused into ``silu_mul``'s readers). For SmolLM-135M's QLoRA at
  4 x 128 tokens these are 0.80 of the 2.46 GB XLA:CPU adds to the state; the plan's peak is
  2.57 GB to XLA:CPU's 2.62 (1.15 to 1.14 scanned, dropout 0; 1.44 and 1.05 before).
- The transients are modelled on what XLA's own ``memory_analysis`` shows for the programs'
  jitted steps (``tests/lm/test_plan.py`` compares the two on 8 simulated CPU devices on small
  models, ``tests/lm/test_plan_real_shapes.py`` on SmolLM-135M's shapes, vocabulary 49152 and
  9/3 heads: fine-tuning within 10%, the trainer within 20%). A microbatch adds every
  parameter's fp32 gradient (whole, before FSDP's reduce-scatter) and a working set: the
  larger of what the fused loss holds while it runs (one chunk's fp32 logits and their
  gradient in the compute dtype, and the table cast to the compute dtype if stored in
  another) and, under remat, one decoder layer's activations without remat (what its
  recomputation holds). The trainer's update donates its inputs and adds the fp32 gradients
  and updates and the new parameters; the fine-tuning program's update, which donates
  nothing, a new copy of its state.

What it does not see: XLA's fusion and scheduling on the target (a GPU can free buffers a
CPU keeps, or keep one more: the terms above are XLA:CPU's, and a GPU's fusion may recompute
a dropout mask or ``sigmoid(gate)`` rather than keep it), XLA:CPU's packing of its
temporary buffers into one allocation, which can exceed what is live at its peak (data=8 on
SmolLM's shapes: 399 MB live, 566 MB allocated, the plan 490 MB), the collectives' buffers,
the CUDA context and cuDNN/cuBLAS workspaces, and allocator fragmentation. Without a scan
XLA:CPU merges remat's recomputation into the forward (``rudax/layers/_remat.py``), so an
unscanned remat plan is the target's, not the CPU's. Under a bf16 compute dtype XLA:CPU
computes every dot in fp32 (fp32 copies of its operands), so its figures are no check of a
bf16 plan. ``fits`` therefore asks for ``--headroom`` (10%) of the device memory to spare.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.extend import core as jex
from jax.sharding import Mesh

import rudax.layers as rl
import rudax.models as rm
import rudax.optim as ro
import rudax.sharding as rs
from examples.lm import config as cfg
from examples.lm.step import make_optimizer, model_spec, shard

FINETUNE = ("none", "lora", "qlora")
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Plan:
    """Bytes per device of one run, by what holds them.

    Attributes:
      state: held between steps: ``params`` (storage dtype; for fine-tuning the frozen base,
        NF4 codes and scales under QLoRA, plus the adapters), ``masters`` (fp32 copies),
        ``optimizer`` (moments and counters), ``accumulator`` (fp32 gradient sums).
      micro: added during one microbatch's forward and backward: ``activations`` (kept for
        the backward), ``kept by XLA`` (what XLA keeps besides: dequantized NF4 weights,
        ``silu_mul``'s intermediates), ``working set`` (the larger of the fused loss's and,
        under remat, one decoder layer's activations), ``gradients`` (fp32, every trainable
        parameter) and, where the step does not donate it, ``new accumulator``.
      apply: added during the optimizer update: ``gradients``, ``updates``, ``new params``
        (the trainer's, which donates its inputs), or the new state (fine-tuning's).
      device_bytes: the device memory planned for, or None.
      headroom: the fraction of ``device_bytes`` left for what the plan does not see.
    """

    state: dict[str, int]
    micro: dict[str, int]
    apply: dict[str, int]
    device_bytes: int | None = None
    headroom: float = 0.1

    @property
    def resident(self) -> int:
        """Bytes held between steps."""
        return sum(self.state.values())

    @property
    def micro_peak(self) -> int:
        """Bytes held at the peak of a microbatch's step."""
        return self.resident + sum(self.micro.values())

    @property
    def apply_peak(self) -> int:
        """Bytes held at the peak of the optimizer update."""
        return self.resident + sum(self.apply.values())

    @property
    def peak(self) -> int:
        """The larger of the two steps' peaks."""
        return max(self.micro_peak, self.apply_peak)

    @property
    def fits(self) -> bool | None:
        """Whether the peak leaves ``headroom`` of ``device_bytes`` free; None if unknown."""
        if self.device_bytes is None:
            return None
        return self.peak <= (1.0 - self.headroom) * self.device_bytes


# ------------------------------------------------------------------------------- counting


def nbytes(x: Any) -> int:
    """Bytes of one array or ShapeDtypeStruct."""
    return math.prod(x.shape) * x.dtype.itemsize


def progress(message: str) -> None:
    """One line on stderr as the plan goes: a 70B plan traces for a minute or more."""
    print(f"plan: {message}", file=sys.stderr, flush=True)


def _layers(spec: rm.ModelSpec) -> str:
    n = spec.config.num_hidden_layers
    return f"{n} layer{'s' * (n != 1)}" + (", scanned" if spec.scan_layers else "")


# Calls whose outputs are their body's outputs: a residual one returns is looked for inside.
_CALLS = ("jit", "pjit", "closed_call", "shard_map")
# Free in XLA: a bitcast of the same buffer.
_BITCASTS = ("reshape", "squeeze", "expand_dims")
_RANDOM_BITS = ("random_bits", "threefry2x32")
# The projections whose outputs rudax.kernels.silu_mul reads (a Llama MLP's).
_SILU_MUL_INPUTS = (("mlp", "gate_proj"), ("mlp", "up_proj"))


def kept_for_backward(loss: Callable[..., Any], params: Any, *args: Any) -> int:
    """Bytes of what ``jax.vjp(loss, params)`` keeps for the backward, as XLA stores them.

    The residuals are those of ``rudax.layers.saved_for_backward`` (traced, nothing
    computed), counted as XLA:CPU's compiled step holds them:

    - a residual the backward never reads costs nothing: XLA removes it as dead code (the
      gradient of a frozen table, which ``rudax.kernels.linear_cross_entropy`` forms in its
      forward; the zeros ``Dropout``'s ``select`` leaves for its transpose);
    - a residual kept in several shapes counts once: a reshape is a bitcast of one buffer
      (the normed input of q, k and v reshaped for each adapter's matmul);
    - a boolean mask drawn from random bits (dropout's) costs 8 bytes an element, not 1:
      XLA fuses ``bits1 ^ bits2``, the conversion to a uniform and the comparison into the
      mask's readers and keeps threefry's two uint32 halves instead (on the CPU they come
      out of a loop, which nothing fuses into).

    Args:
      loss: ``loss(params, *args)``, a scalar.
      params: what the gradient is taken of (arrays or ShapeDtypeStructs).
      *args: the loss's other arguments.

    Returns:
      The bytes, of the arrays as the traced program has them (global shapes over a mesh).
    """

    def forward(p: Any, *a: Any) -> Any:
        return jax.vjp(lambda q: loss(q, *a), p)

    traced, (out, backward) = jax.make_jaxpr(forward, return_shape=True)(params, *args)
    outputs = len(jax.tree.leaves(out))  # the loss's, then the residuals
    leaves, treedef = jax.tree.flatten(backward)
    # The backward alone, from the residuals and the cotangent: which residuals it reads.
    read = jax.make_jaxpr(lambda res, ct: jax.tree.unflatten(treedef, res)(ct))(leaves, out)
    used = _used_inputs(read.jaxpr, [True] * len(read.jaxpr.outvars))[: len(leaves)]
    top = traced.jaxpr
    free = {v for v in (*top.invars, *top.constvars)}
    producers: dict[int, dict[Any, Any]] = {}  # of each jaxpr met, by id
    found: dict[Any, int] = {}
    for v, leaf, is_read in zip(top.outvars[outputs:], leaves, used, strict=True):
        if not is_read or not isinstance(v, jex.Var) or v in free:
            continue
        origin = _origin(v, top, producers)
        if origin is None:  # an input, a constant, or a bitcast of one
            continue
        key, eqn, made = origin
        if leaf.dtype == jnp.bool_ and _draws_random_bits(eqn, made, set()):
            found[key] = 8 * math.prod(leaf.shape)  # threefry's two uint32 halves
        else:
            found.setdefault(key, nbytes(leaf))
    return sum(found.values())


def _body(eqn: Any) -> Any:
    """The jaxpr of a call whose inputs and outputs are its body's, else None."""
    if eqn.primitive.name not in _CALLS:
        return None
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    body = getattr(body, "jaxpr", body)  # a ClosedJaxpr's jaxpr
    if body is None or (len(body.invars), len(body.outvars)) != (len(eqn.invars), len(eqn.outvars)):
        return None
    return body


def _producers(jaxpr: Any, producers: dict[int, dict[Any, Any]]) -> dict[Any, Any]:
    """The equation that makes each of ``jaxpr``'s vars, kept in ``producers``."""
    made = producers.get(id(jaxpr))
    if made is None:
        made = producers[id(jaxpr)] = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    return made


def _origin(
    v: Any, top: Any, producers: dict[int, dict[Any, Any]]
) -> tuple[Any, Any, dict[Any, Any]] | None:
    """Where a residual is made: ``(key, eqn, the producers of eqn's jaxpr)``, following it
    into the calls that return it and back through bitcasts; None for an input or a constant.
    ``key`` names the buffer: the var and the calls it was found in (a jitted function's body
    is one jaxpr for every call site)."""
    stack: list[tuple[Any, Any]] = [(top, None)]  # (jaxpr, the call into it)
    while True:
        if not isinstance(v, jex.Var):
            return None  # a literal
        jaxpr, call = stack[-1]
        made = _producers(jaxpr, producers)
        eqn = made.get(v)
        if eqn is None:
            if call is None or v not in jaxpr.invars:
                return None  # an input of the step, or a constant
            stack.pop()
            v = call.invars[jaxpr.invars.index(v)]
            continue
        if eqn.primitive.name in _BITCASTS:
            v = eqn.invars[0]
            continue
        body = _body(eqn)
        if body is not None:
            stack.append((body, eqn))
            v = body.outvars[eqn.outvars.index(v)]
            continue
        return (tuple(id(c) for _, c in stack[1:]), v), eqn, made


def _draws_random_bits(eqn: Any, made: dict[Any, Any], seen: set[int], depth: int = 12) -> bool:
    """Whether ``eqn``'s output is computed from random bits: through its operands'
    equations (``made``: their jaxpr's producers; ``depth`` of them at most) and into the
    calls they come from."""
    if eqn.primitive.name in _RANDOM_BITS:
        return True
    body = _body(eqn)
    if body is not None:
        return _contains_random_bits(body)
    if depth == 0 or id(eqn) in seen:
        return False
    seen.add(id(eqn))
    return any(
        _draws_random_bits(made[v], made, seen, depth - 1)
        for v in eqn.invars
        if isinstance(v, jex.Var) and v in made
    )


def _contains_random_bits(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _RANDOM_BITS:
            return True
        for inner in jex.jaxprs_in_params(eqn.params):
            if _contains_random_bits(getattr(inner, "jaxpr", inner)):
                return True
    return False


def _used_inputs(jaxpr: Any, used_outputs: Sequence[bool]) -> list[bool]:
    """Which of ``jaxpr``'s inputs its used outputs depend on (dead-code elimination, into
    jitted calls; any other call with a used output reads all its inputs)."""
    live = {v for v, u in zip(jaxpr.outvars, used_outputs, strict=True) if u}
    for eqn in reversed(jaxpr.eqns):
        outs = [isinstance(v, jex.Var) and v in live for v in eqn.outvars]
        if not any(outs) and not eqn.effects:
            continue
        body = _body(eqn)
        if body is not None and not eqn.effects:
            ins = _used_inputs(body, outs)
        else:
            ins = [True] * len(eqn.invars)
        live.update(v for v, u in zip(eqn.invars, ins, strict=True) if u and isinstance(v, jex.Var))
    return [v in live for v in jaxpr.invars]


# ------------------------------------------------------------------------------- plans


def _loss_working_set(spec: rm.ModelSpec, rows: int, *, table_trained: bool) -> int:
    """What the fused loss holds while it runs, beyond the activations: one chunk's fp32
    logits and their gradient (``softmax - one_hot``, in the compute dtype: it is formed
    before the logits are freed), and the table cast to the compute dtype if it is stored
    in another. A trained table's fp32 gradient, counted among the activations, is formed
    once the cast is no longer read, unless several chunks run (it is their scan's carry)."""
    config = spec.config
    tokens = rows * spec.seq_len
    chunk = min(spec.loss_chunk, tokens)
    c = jnp.dtype(spec.dtype).itemsize
    table = config.vocab_size * config.hidden_size
    cast = table * c if jnp.dtype(config.param_dtype) != jnp.dtype(spec.dtype) else 0
    if table_trained and chunk == tokens:
        cast = max(0, cast - table * 4)
    return chunk * config.vocab_size * (4 + c) + cast


def _kept_by_xla(spec: rm.ModelSpec, model: Any, rows: int) -> int:
    """What XLA:CPU keeps from the forward for the backward besides JAX's residuals, when
    the layers are neither scanned nor rematerialized (then forward and backward are one
    straight-line program):

    - each ``NF4Linear``'s weight dequantized to the compute dtype: ``nf4_matmul``'s backward
      dequantizes it again and XLA's CSE merges the two, so the forward's copy lives until
      the backward (a scan's forward and backward are separate loops; remat's recomputation
      is fenced off by an optimization barrier);
    - each dense MLP's ``sigmoid(gate)`` and ``gate * sigmoid(gate)``, which
      ``rudax.kernels.silu_mul``'s backward recomputes from gate and up, merged likewise;
    - a LoRA'd ``gate_proj`` or ``up_proj``'s output as its two summands (the base's and the
      adapter's): XLA fuses the sum into ``silu_mul``'s readers, forward and backward.
    """
    if spec.scan_layers or spec.remat != "none":
        return 0
    config = spec.config
    tokens = rows * spec.seq_len
    c = jnp.dtype(spec.dtype).itemsize
    kept = 0
    if config.num_local_experts is None:
        kept += config.num_hidden_layers * 2 * tokens * config.intermediate_size * c
    for path, module in nnx.iter_graph(model):
        if isinstance(module, rl.NF4Linear):
            kept += module.in_features * module.out_features * c
        elif isinstance(module, rl.LoRALinear) and path[-2:] in _SILU_MUL_INPUTS:
            kept += tokens * module.out_features * c
    return kept


def _micro(
    spec: rm.ModelSpec, rows: int, kept: Callable[[rm.ModelSpec], tuple[int, int]], loss: int
) -> dict[str, int]:
    """What a microbatch adds besides its gradients and accumulator: the activations kept
    for the backward and what XLA keeps besides (``kept(spec)``), and the larger of the loss's
    working set (``loss``) and, under remat, the backward's: one decoder layer's as it is
    without remat, ``kept`` of two plain layers less one, which its recomputation holds while
    the layer's backward runs. (Without remat a layer's backward reads activations counted
    already, and frees them as it goes.) The two come one after the other, at the loss and
    then in each layer, so only the larger counts."""

    def plain(n: int) -> int:
        config = dataclasses.replace(spec.config, num_hidden_layers=n)
        return sum(kept(dataclasses.replace(spec, config=config, remat="none", scan_layers=False)))

    activations, by_xla = kept(spec)
    layer = 0
    if spec.remat != "none":
        progress("tracing one and two plain layers (the backward's working set)...")
        layer = plain(2) - plain(1)
    return {
        "activations": activations,
        "kept by XLA": by_xla,
        "working set": max(layer, loss),
    }


def optimizer_state(tx: optax.GradientTransformation, trainable: Any) -> tuple[Any, Any]:
    """The abstract ``(tx.init(trainable), GradientAccumulator.init(trainable, float32))``."""
    opt_state = jax.eval_shape(tx.init, trainable)
    acc = jax.eval_shape(lambda p: ro.GradientAccumulator.init(p, jnp.float32), trainable)
    return opt_state, acc


def plan_pretraining(
    args: argparse.Namespace, spec: rm.ModelSpec, *, device_bytes: int | None = None
) -> Plan:
    """The plan of ``examples.lm.train`` with these flags, its model ``spec``."""
    cfg.check(args)  # what the trainer refuses (say muon over fsdp) has no plan
    mesh = dict(args.mesh or {})
    devices, fsdp = math.prod(mesh.values()) if mesh else 1, mesh.get("fsdp", 1)
    rows = args.batch_size // devices
    mesh_obj = None if not mesh else trace_mesh(mesh)
    # the state as the run holds it (sharded over fsdp: each leaf, or each layer's slice of
    # a stacked one, padded on its own), and the logical parameters the gradients have
    progress(f"building the model abstractly ({_layers(spec)})...")
    _, params, _ = nnx.split(trained_model(spec, mesh_obj), nnx.Param, ...)
    _, logical, _ = nnx.split(trained_model(spec, None), nnx.Param, ...)
    tx = make_optimizer(args, mesh_obj)  # over fsdp, Muon is rudax.sharding.fsdp_muon
    opt_state, acc = optimizer_state(tx, params)
    masters = _masters(opt_state)

    def kept(s: rm.ModelSpec) -> tuple[int, int]:
        # The trainer's own loss (over a mesh, its shard_map'd loss): under FSDP what is kept
        # is each device's shard of the parameters, or the gathered weights, as the step
        # really keeps them. shard_map's residuals come out stacked over the devices.
        model = trained_model(s, mesh_obj)
        graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        batch = jax.ShapeDtypeStruct((args.batch_size, s.seq_len + 1), jnp.int32)
        loss = functools.partial(rm.next_token_loss_sum, chunk=s.loss_chunk)
        steps = rs.make_train_steps(graphdef, optax.identity(), loss, mesh=mesh_obj)
        activations = kept_for_backward(steps.forward, params, rngs, rest, batch) // devices
        return activations, _kept_by_xla(s, model, rows)

    fp32_local = rs.bytes_per_device(jax.tree.map(_as_fp32, params), fsdp)
    state = {
        "params": rs.bytes_per_device(params, fsdp),
        "masters": rs.bytes_per_device(masters, fsdp),
        "optimizer": rs.bytes_per_device(opt_state, fsdp) - rs.bytes_per_device(masters, fsdp),
        "accumulator": rs.bytes_per_device(acc, fsdp),
    }
    progress(f"tracing the forward and backward of {_layers(spec)} (the activations)...")
    micro = {
        **_micro(spec, rows, kept, _loss_working_set(spec, rows, table_trained=True)),
        "gradients": _gradients(logical, fsdp, scanned=spec.scan_layers),
        # No new accumulator: micro donates the old one, whose buffer the new sums take.
    }
    apply = {"gradients": fp32_local, "updates": fp32_local, "new params": state["params"]}
    return Plan(state, micro, apply, device_bytes=device_bytes, headroom=args.headroom)


def plan_finetuning(
    args: argparse.Namespace, spec: rm.ModelSpec, *, device_bytes: int | None = None
) -> Plan:
    """The plan of ``examples.finetune`` (one device): LoRA adapters of ``--rank`` on every
    projection, the base NF4 under ``qlora``, AdamW (no masters: the adapters are fp32)."""
    if args.mesh:
        raise cfg.UsageError(
            f"--mesh {rs.mesh_text(args.mesh)}: examples.finetune runs on one device; plan "
            "one device's share (its --batch-size) and run data-parallel replicas of it"
        )

    if spec.scan_layers and args.dropout > 0:  # examples.finetune refuses it too
        raise cfg.UsageError(
            f"--scan-layers needs --dropout 0 (got {args.dropout}): a scan would give every "
            "layer the same dropout masks"
        )

    def split(s: rm.ModelSpec) -> tuple[Any, Any]:
        model = nnx.eval_shape(lambda: finetune_model(args, s))
        return model, nnx.split(model, rl.LoRAParam, nnx.RngState, ...)

    # built once: a 70B model takes tens of seconds to trace
    progress(f"building the model abstractly ({_layers(spec)}, its base {args.finetune})...")
    full = split(spec)

    def kept(s: rm.ModelSpec) -> tuple[int, int]:
        model, (graphdef, adapters, rngs, base) = full if s == spec else split(s)
        shape = (args.batch_size, s.seq_len)
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in FINETUNE_BATCH}

        # The frozen base and the RNG state are inputs of the step: what is kept of them as
        # they are costs nothing more, what is derived from them (a cast weight) counts.
        def loss(a: Any, b: Any, base: Any, rngs: Any) -> Any:
            model = nnx.merge(graphdef, a, rngs, base, copy=True)
            return rm.causal_lm_loss_sum(model, b, chunk=s.loss_chunk)[0]

        activations = kept_for_backward(loss, adapters, batch, base, rngs)
        return activations, _kept_by_xla(s, model, args.batch_size)

    _, (_, adapters, rngs, base) = full
    tx = finetune_optimizer()
    opt_state, acc = optimizer_state(tx, adapters)
    state = {
        "params": rs.bytes_per_device(base)
        + rs.bytes_per_device(adapters)
        + rs.bytes_per_device(rngs),
        "masters": 0,
        "optimizer": rs.bytes_per_device(opt_state),
        "accumulator": rs.bytes_per_device(acc),
    }
    progress(f"tracing the forward and backward of {_layers(spec)} (the activations)...")
    loss = _loss_working_set(spec, args.batch_size, table_trained=False)
    micro = {
        **_micro(spec, args.batch_size, kept, loss),
        "gradients": _gradients(adapters, 1, scanned=spec.scan_layers),
        "new accumulator": state["accumulator"],
    }
    # examples.finetune donates nothing: the update writes a new copy of its whole state.
    apply = {
        "new params": rs.bytes_per_device(adapters),
        "new optimizer": state["optimizer"],
        "new accumulator": state["accumulator"],
    }
    return Plan(state, micro, apply, device_bytes=device_bytes, headroom=args.headroom)


def _gradients(params: Any, fsdp: int, *, scanned: bool) -> int:
    """The fp32 gradients a microbatch holds at once, per device.

    Every parameter's, whole, as XLA:CPU holds them, under FSDP before their reduce-scatter;
    except with FSDP over scanned layers, where each layer's gradients are reduce-scattered
    in the scan's own iteration: then each device's shard of all of them, one layer's whole
    and the rest of the model's (embedding, head, final norm) whole.

    Args:
      params: the logical parameters (the layers stacked when ``scanned``).
      fsdp: the fsdp axis's size.
      scanned: the layers are stored stacked and scanned.
    """
    fp32 = jax.tree.map(_as_fp32, params)
    whole = rs.bytes_per_device(fp32)
    if fsdp == 1 or not scanned:
        return whole
    layers = fp32["model"]["layers"]  # stacked: each leaf's leading axis is the layer
    count = jax.tree.leaves(layers)[0].shape[0]
    one = rs.bytes_per_device(layers) // count
    return rs.bytes_per_device(fp32, fsdp) + one + whole - rs.bytes_per_device(layers)


def trained_model(spec: rm.ModelSpec, mesh: Mesh | None) -> rm.LlamaForCausalLM:
    """The model of ``spec`` as ``examples.lm.train`` runs it on ``mesh``, abstract
    (``ShapeDtypeStruct`` leaves): FSDP-sharded (``examples.lm.step.shard``) if the mesh has
    an ``fsdp`` axis, else whole (replicated over ``data``)."""
    # spec.create evaluated abstractly: the trainer's own build, its layers stacked inside the
    # evaluation (ModelSpec.abstract stacks them on the host, which jnp.stack refuses for
    # ShapeDtypeStructs)
    if mesh is None or "fsdp" not in mesh.axis_names:
        return nnx.eval_shape(lambda: spec.create(0))
    return nnx.eval_shape(lambda: shard(spec.create(0), mesh))


def finetune_model(args: argparse.Namespace, spec: rm.ModelSpec) -> rm.LlamaForCausalLM:
    """The model of ``spec`` as ``examples.finetune`` trains it: a ``rudax.models``
    ``LlamaForCausalLM`` (``spec``'s compute dtype and remat), ``--rank`` adapters on every
    projection, each base projection NF4 under ``--finetune qlora``, then its layers stacked
    if ``spec.scan_layers``."""
    model = rm.LlamaForCausalLM(
        spec.config,
        dtype=spec.dtype,
        remat=spec.remat,  # type: ignore[arg-type]
        rngs=nnx.Rngs(0),
    )
    quantize = "nf4" if args.finetune == "qlora" else None
    rl.apply_lora(
        model,
        list(rm.PROJECTIONS),
        rank=args.rank,
        alpha=2.0 * args.rank,
        dropout=args.dropout,
        quantize_base=quantize,
        quantize_untargeted=quantize is not None,
        rngs=nnx.Rngs(0),
    )
    model.scan_layers = spec.scan_layers  # stacked after the adapters, as the program does
    return model


def finetune_optimizer() -> optax.GradientTransformation:
    """``examples.finetune``'s optimizer; its hyperparameters change no shape."""
    return optax.chain(ro.clip_by_global_norm(1.0), ro.adamw(1e-3, weight_decay=0.0))


def trace_mesh(spec: dict[str, int]) -> Mesh:
    """A mesh of ``spec``'s shape: of this process's devices if it has that many (the GPUs
    of a GPU machine), else of simulated CPU devices. Steps are traced or compiled on it,
    never run."""
    n = math.prod(spec.values())
    try:  # before the backend starts; python -m examples.lm.plan gets there first
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass
    devices = jax.devices()
    if len(devices) < n:
        devices = jax.devices("cpu")
    if len(devices) < n:
        raise cfg.UsageError(
            f"--mesh {rs.mesh_text(spec)}: tracing its step needs {n} CPU devices, this "
            f"process has {len(devices)} (JAX started before the plan could set them)"
        )
    return Mesh(np.array(devices[:n]).reshape(tuple(spec.values())), tuple(spec))


FINETUNE_BATCH = ("tokens", "labels", "segment_ids", "positions")


def _as_fp32(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, jnp.float32)


def _masters(opt_state: Any) -> Any:
    """The fp32 master weights inside an optimizer state (``fp32_master``, ``fused_adamw``)."""
    kinds = (ro.Fp32MasterState, ro.FusedAdamWState)
    found = [
        s.master
        for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, kinds))
        if isinstance(s, kinds)
    ]
    return found


# ------------------------------------------------------------------------------- program


def model_of(args: argparse.Namespace) -> rm.ModelSpec:
    """The model of the flags (``examples.lm.step.model_spec``), or of ``--hf-config`` with the
    flags' storage and compute dtypes, sequence length, remat and scanned layers; its loss
    chunk ``--loss-chunk``'s (0: one chunk of the whole batch's tokens).

    Example:
      >>> from examples.lm import plan
      >>> args = plan.build_parser().parse_args(["--d-model", "64", "--loss-chunk", "0"])
      >>> spec = plan.model_of(args)
      >>> spec.config.hidden_size, spec.seq_len, spec.loss_chunk == args.batch_size * 256
      (64, 256, True)
    """
    if args.hf_config is None:
        spec = model_spec(args)
    else:
        hf = json.loads(Path(args.hf_config).read_text())
        positions = hf.get("max_position_embeddings")
        if isinstance(positions, int) and args.seq_len > positions:
            # as examples.finetune refuses it: RoPE was never trained past the model's
            # positions, and a plan of such a length can run for minutes
            raise cfg.UsageError(
                f"--seq-len {args.seq_len} is more than the {positions} positions of "
                f"{args.hf_config} (max_position_embeddings)"
            )
        spec = rm.ModelSpec(
            rm.LlamaConfig.from_hf(hf, param_dtype=jnp.dtype(args.param_dtype)),
            seq_len=args.seq_len,
            dtype=jnp.dtype(args.compute_dtype),
            remat=args.remat,
            scan_layers=args.scan_layers,
            embedding_backward="sorted" if args.deterministic else "scatter",
        )
    if args.loss_chunk is not None:
        # 0: every token of a microbatch in one chunk (the whole batch's bounds any device's)
        chunk = args.loss_chunk or args.batch_size * args.seq_len
        spec = dataclasses.replace(spec, loss_chunk=chunk)
    return spec


def make_plan(args: argparse.Namespace) -> Plan:
    """The plan of the parsed flags (``build_parser``)."""
    spec = model_of(args)
    device_bytes = None if args.device_memory is None else int(args.device_memory * GB)
    if args.finetune == "none":
        return plan_pretraining(args, spec, device_bytes=device_bytes)
    return plan_finetuning(args, spec, device_bytes=device_bytes)


def format_plan(plan: Plan) -> str:
    """The plan as a table of GB (1e9 bytes) per device."""
    lines = [f"{'per device':<28}{'GB':>10}"]
    row = lambda name, n: lines.append(f"{name:<28}{n / GB:>10.3f}")
    for title, part in (("held", plan.state), ("+ microbatch", plan.micro)):
        lines.append(title)
        for name, n in part.items():
            row("  " + name, n)
    lines.append("+ update")
    for name, n in plan.apply.items():
        row("  " + name, n)
    row("resident", plan.resident)
    row("peak: microbatch", plan.micro_peak)
    row("peak: update", plan.apply_peak)
    if plan.device_bytes is not None:
        free = (1.0 - plan.headroom) * plan.device_bytes
        verdict = "fits" if plan.fits else "does NOT fit"
        lines.append(
            f"{verdict}: peak {plan.peak / GB:.1f} GB of {free / GB:.1f} GB "
            f"({plan.device_bytes / GB:.0f} GB less {plan.headroom:.0%} headroom)"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's parser, plus the plan's own flags."""
    p = cfg.build_parser()
    p.prog, p.description = "python -m examples.lm.plan", "Per-device memory of a run."
    plan = p.add_argument_group("plan")
    plan.add_argument("--hf-config", help="a Hugging Face config.json: the model (not the flags)")
    plan.add_argument("--finetune", choices=FINETUNE, default="none", help="examples.finetune")
    plan.add_argument("--rank", type=cfg.positive_int, default=8, help="LoRA rank (--finetune)")
    plan.add_argument(
        "--dropout",
        type=cfg.unit_interval,
        default=0.05,
        help="LoRA dropout (--finetune; its masks)",
    )
    plan.add_argument(
        "--loss-chunk",
        type=cfg.non_negative_int,
        help="tokens per chunk of the fused head and loss (default: the trainer's 1024; "
        "examples.finetune's is 1024); 0: one chunk of all a microbatch's tokens (the loss "
        "always goes through rudax.kernels.linear_cross_entropy)",
    )
    plan.add_argument(
        "--device-memory", type=cfg.positive_float, help="GB (1e9 bytes) of each device"
    )
    plan.add_argument(
        "--xla",
        action="store_true",
        help="also compile the steps for this backend and print XLA's memory_analysis "
        "(a GPU's own numbers on a GPU machine; about a minute for a scanned 7B on a CPU)",
    )
    plan.add_argument(
        "--headroom", type=cfg.unit_interval, default=0.1, help="fraction left unplanned, in [0, 1)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> Plan:
    """Prints the plan of the flags; returns it (for tests)."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        plan = make_plan(args)
    except (cfg.UsageError, ValueError, TypeError, OSError) as e:
        parser.error(str(e))
    print(format_plan(plan))
    if args.xla:
        from examples.lm import plan_xla  # it imports this module

        print(plan_xla.format_xla(plan, *plan_xla.compiled_steps(args)))
    return plan


if __name__ == "__main__":
    main()
