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
trainer's ``examples.lm.spec.ModelSpec`` (a ``rudax.models.LlamaForCausalLM``), of the flags
or of ``--hf-config``. Nothing is allocated and nothing compiled: the model, the optimizer
state and the accumulator are built abstractly (``nnx.eval_shape``, ``jax.eval_shape``): on
a 2-core CPU a 7B plan takes seconds, a 70B QLoRA one a minute with ``--scan-layers`` and
eight without (80 layers traced).
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
  residuals (no second copy of a QLoRA's NF4 base).
- The transients are modelled on what XLA's own ``memory_analysis`` shows for the programs'
  jitted steps (``tests/lm/test_plan.py`` compares the two on 8 simulated CPU devices;
  measured 0.73-0.88x XLA's for a microbatch, 0.98-1.16x for the update, and held to within
  35%). A microbatch adds every parameter's fp32 gradient (whole, before FSDP's
  reduce-scatter) and a working set: the larger of one chunk of the fused loss's fp32 logits
  and one decoder layer's activations without remat (what the layer's backward, or its
  recomputation, holds while it runs). The trainer's update
  donates its inputs and adds the fp32 gradients and updates and the new parameters; the
  fine-tuning program's update, which donates nothing, a new copy of its state.

What it does not see: XLA's fusion and scheduling on the target (a GPU can free buffers a
CPU keeps, or keep one more), the collectives' buffers, the CUDA context and cuDNN/cuBLAS
workspaces, and allocator fragmentation. ``fits`` therefore asks for ``--headroom`` (10%) of
the device memory to spare.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from jax.sharding import Mesh

import rudax.layers as rl
import rudax.models as rm
import rudax.optim as ro
import rudax.sharding as rs
from examples.lm import config as cfg
from examples.lm.spec import ModelSpec, shard
from examples.lm.step import make_optimizer, make_steps, model_spec

FINETUNE = ("none", "lora", "qlora")
# examples.finetune's adapters: every attention and MLP projection (peft's names).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Plan:
    """Bytes per device of one run, by what holds them.

    Attributes:
      state: held between steps: ``params`` (storage dtype; for fine-tuning the frozen base,
        NF4 codes and scales under QLoRA, plus the adapters), ``masters`` (fp32 copies),
        ``optimizer`` (moments and counters), ``accumulator`` (fp32 gradient sums).
      micro: added during one microbatch's forward and backward: ``activations`` (kept for
        the backward), ``working set`` (the larger of a logits chunk and one decoder layer's
        activations), ``gradients`` (fp32, every trainable parameter) and, where the step
        does not donate it, ``new accumulator``.
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


# ------------------------------------------------------------------------------- plans


def _loss_chunk_bytes(spec: ModelSpec, rows: int) -> int:
    """The fused loss's fp32 logits for one chunk of a microbatch's tokens."""
    tokens = min(spec.loss_chunk, rows * spec.seq_len)
    return tokens * spec.config.vocab_size * 4


def _micro(spec: ModelSpec, rows: int, saved: Callable[[ModelSpec], int]) -> dict[str, int]:
    """What a microbatch adds besides its gradients and accumulator: the activations kept
    for the backward (``saved(spec)``), and the larger of the loss's logits chunk and the
    backward's working set. That is one decoder layer's activations as they are without
    remat: ``saved`` of two plain layers less one, what a layer's backward (or, under remat,
    its recomputation) holds while it runs. The two come one after the other, at the loss and
    then in each layer, so only the larger counts."""

    def plain(n: int) -> int:
        config = dataclasses.replace(spec.config, num_hidden_layers=n)
        return saved(dataclasses.replace(spec, config=config, remat="none", scan_layers=False))

    return {
        "activations": saved(spec),
        "working set": max(plain(2) - plain(1), _loss_chunk_bytes(spec, rows)),
    }


def optimizer_state(tx: optax.GradientTransformation, trainable: Any) -> tuple[Any, Any]:
    """The abstract ``(tx.init(trainable), GradientAccumulator.init(trainable, float32))``."""
    opt_state = jax.eval_shape(tx.init, trainable)
    acc = jax.eval_shape(lambda p: ro.GradientAccumulator.init(p, jnp.float32), trainable)
    return opt_state, acc


def plan_pretraining(
    args: argparse.Namespace, spec: ModelSpec, *, device_bytes: int | None = None
) -> Plan:
    """The plan of ``examples.lm.train`` with these flags, its model ``spec``."""
    cfg.check(args)  # what the trainer refuses (say muon over fsdp) has no plan
    mesh = dict(args.mesh or {})
    devices, fsdp = math.prod(mesh.values()) if mesh else 1, mesh.get("fsdp", 1)
    rows = args.batch_size // devices
    mesh_obj = None if not mesh else trace_mesh(mesh)
    # the state as the run holds it (sharded over fsdp: each leaf, or each layer's slice of
    # a stacked one, padded on its own), and the logical parameters the gradients have
    _, params, _ = nnx.split(trained_model(spec, mesh_obj), nnx.Param, ...)
    _, logical, _ = nnx.split(trained_model(spec, None), nnx.Param, ...)
    tx = make_optimizer(args)
    opt_state, acc = optimizer_state(tx, params)
    masters = _masters(opt_state)

    def saved(s: ModelSpec) -> int:
        # The trainer's own loss (over a mesh, its shard_map'd loss): under FSDP what is kept
        # is each device's shard of the parameters, or the gathered weights, as the step
        # really keeps them. shard_map's residuals come out stacked over the devices.
        graphdef, params, rest = nnx.split(trained_model(s, mesh_obj), nnx.Param, ...)
        batch = jax.ShapeDtypeStruct((args.batch_size, s.seq_len + 1), jnp.int32)
        steps = make_steps(
            graphdef, rest, None, mesh=mesh_obj, donate=False, loss_chunk=s.loss_chunk
        )
        return sum(map(nbytes, rl.saved_for_backward(steps.forward, params, batch))) // devices

    fp32_local = rs.bytes_per_device(jax.tree.map(_as_fp32, params), fsdp)
    state = {
        "params": rs.bytes_per_device(params, fsdp),
        "masters": rs.bytes_per_device(masters, fsdp),
        "optimizer": rs.bytes_per_device(opt_state, fsdp) - rs.bytes_per_device(masters, fsdp),
        "accumulator": rs.bytes_per_device(acc, fsdp),
    }
    micro = {
        **_micro(spec, rows, saved),
        "gradients": _gradients(logical, fsdp, scanned=spec.scan_layers),
        # No new accumulator: micro donates the old one, whose buffer the new sums take.
    }
    apply = {"gradients": fp32_local, "updates": fp32_local, "new params": state["params"]}
    return Plan(state, micro, apply, device_bytes=device_bytes, headroom=args.headroom)


def plan_finetuning(
    args: argparse.Namespace, spec: ModelSpec, *, device_bytes: int | None = None
) -> Plan:
    """The plan of ``examples.finetune`` (one device): LoRA adapters of ``--rank`` on every
    projection, the base NF4 under ``qlora``, AdamW (no masters: the adapters are fp32)."""
    if args.mesh:
        raise cfg.UsageError(
            f"--mesh {cfg.mesh_text(args.mesh)}: examples.finetune runs on one device; plan "
            "one device's share (its --batch-size) and run data-parallel replicas of it"
        )

    if spec.scan_layers and args.dropout > 0:  # examples.finetune refuses it too
        raise cfg.UsageError(
            f"--scan-layers needs --dropout 0 (got {args.dropout}): a scan would give every "
            "layer the same dropout masks"
        )

    def split(s: ModelSpec) -> Any:
        return nnx.split(
            nnx.eval_shape(lambda: finetune_model(args, s)), rl.LoRAParam, nnx.RngState, ...
        )

    full = split(spec)  # built once: a 70B model takes tens of seconds to trace

    def saved(s: ModelSpec) -> int:
        graphdef, adapters, rngs, base = full if s == spec else split(s)
        shape = (args.batch_size, s.seq_len)
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in FINETUNE_BATCH}

        # The frozen base and the RNG state are inputs of the step: what is kept of them as
        # they are costs nothing more, what is derived from them (a dequantized weight) counts.
        def loss(a: Any, b: Any, base: Any, rngs: Any) -> Any:
            model = nnx.merge(graphdef, a, rngs, base, copy=True)
            return rm.causal_lm_loss_sum(model, b, chunk=s.loss_chunk)[0]

        return sum(map(nbytes, rl.saved_for_backward(loss, adapters, batch, base, rngs)))

    _, adapters, rngs, base = full
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
    micro = {
        **_micro(spec, args.batch_size, saved),
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


def trained_model(spec: ModelSpec, mesh: Mesh | None) -> rm.LlamaForCausalLM:
    """The model of ``spec`` as ``examples.lm.train`` runs it on ``mesh``, abstract
    (``ShapeDtypeStruct`` leaves): FSDP-sharded (``examples.lm.spec.shard``) if the mesh has
    an ``fsdp`` axis, else whole (replicated over ``data``)."""
    # spec.create evaluated abstractly: the trainer's own build, its layers stacked inside the
    # evaluation (ModelSpec.abstract stacks them on the host, which jnp.stack refuses for
    # ShapeDtypeStructs)
    if mesh is None or "fsdp" not in mesh.axis_names:
        return nnx.eval_shape(lambda: spec.create(0))
    return nnx.eval_shape(lambda: shard(spec.create(0), mesh))


def finetune_model(args: argparse.Namespace, spec: ModelSpec) -> rm.LlamaForCausalLM:
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
        list(PROJECTIONS),
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
            f"--mesh {cfg.mesh_text(spec)}: tracing its step needs {n} CPU devices, this "
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


def model_of(args: argparse.Namespace) -> ModelSpec:
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
        spec = ModelSpec(
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
