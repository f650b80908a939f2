"""FSDP at 8 simulated devices: the state's bytes per device and each step's collectives (issue 30).

    python -m benchmarks.fsdp_comm                        # the trainer's default Llama, ~1.5 min
    python -m benchmarks.fsdp_comm --d-model 128 --n-layers 2 --json out.json

Two programs, as they run over ``--mesh data=D,fsdp=F``:

- the trainer (``examples.lm``): its recipe (``benchmarks._trainer.trainer_recipe``:
  ``LlamaConfig.tiny`` at the given sizes), bf16 storage sharded by ``rudax.models.shard``
  (gathered in fp32, as the trainer does), ``OptimizerSpec.build(mesh)`` (fp32 masters,
  clipping, AdamW or Muon: ``rudax.sharding.fsdp_muon`` over ``fsdp``), the state placed by
  ``rudax.sharding.place``;
- the fine-tuner (``examples.finetune``): a tiny random HF Llama saved here as
  ``tests/finetune/conftest.py::tiny_base`` saves one (nothing downloaded), read back with
  ``rudax.models.from_pretrained(quantize="nf4")`` (every projection NF4, the embedding,
  norms and head bf16), rank-``--rank`` adapters on every projection, ``--dropout 0``,
  sharded by ``rudax.models.shard``, placed by ``rudax.sharding.place`` and stepped by
  ``rudax.sharding.make_train_steps``, as ``examples.finetune`` runs them.

**Bytes per device** are the placed arrays' ``addressable_shards[0].data.nbytes`` summed, at
one device (the unsharded state), and over ``data=2,fsdp=4`` and ``fsdp=8`` (the data replicas
hold the same as ``fsdp=4`` alone). Each cell gives the ratio to the one-device bytes over F,
and ``pad`` is ``rudax.sharding.bytes_per_device``'s figure (each flat leaf padded to a
multiple of F, 1/F of it per device) against that 1/F.

**Communication** is read from each compiled step, ``jit(...).lower(...).compile().as_text()``:
every all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute instruction,
its operand and result bytes, and what a ring sends per device for it, ``(G - 1) / G`` of the
gathered or scattered buffer (twice that for an all-reduce), G its replica group; one inside
a ``while`` body (``--scan-layers``) counts once per trip. That is one device's SPMD program,
per microbatch (``micro``) and per optimizer update (``apply``). The trainer's arms: AdamW
(micro and apply), Muon (apply: the optimizer enters no other step), and AdamW's microbatch
with ``--remat full``, without and with ``--scan-layers``.

The analytic rule beside it is FSDP's textbook step: the forward all-gathers every sharded
parameter (padded, in the dtype it is gathered in: fp32 for the trainer, as stored for the
fine-tuner's base), the backward gathers it again unless the forward's copy is kept
(``x2 rule``), each trained parameter's gradient is reduce-scattered once in fp32, and over
``data`` each gradient *shard* is all-reduced. Muon's update all-to-alls each matrix's shards
to one device and back, in its bf16 Newton-Schulz dtype (``rudax/sharding/_muon.py``, rounds
padded to F matrices). An all-gather is compared by its result (what it gathers), the others
by their operands; the ratio is to the rule in XLA:CPU's dtypes (a 16-bit float moves as f32).

XLA:CPU runs on simulated devices sharing this machine's cores, so only what is counted here
means anything, not how fast it goes: the bytes of the state and of the collectives are the
program's, the same on 8 accelerators up to the backend's fusion decisions (XLA:CPU runs a
bf16 collective in f32, for one).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

try:  # before the CPU backend starts (a test's conftest may have started it with 8)
    jax.config.update("jax_num_cpu_devices", 8)
except RuntimeError:
    pass

import argparse
import dataclasses
import functools
import json
import math
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

import rudax.layers as rl
import rudax.models as rm
import rudax.optim as ro
import rudax.sharding as rs
from benchmarks._trainer import trainer_recipe

N = 8
MESHES = ("data=2,fsdp=4", "fsdp=8")
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
MiB = 2**20

# ------------------------------------------------------------------------------- HLO


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program (one device's view)."""

    kind: str  # one of KINDS
    operand_bytes: int
    result_bytes: int
    group: int  # devices in its replica group
    dtypes: tuple[str, ...]
    times: int = 1  # executions per call: the trip counts of the loops it is in

    @property
    def sent(self) -> float:
        """Bytes one device sends for it with a ring: (G-1)/G of the full buffer, x2 all-reduce."""
        share = (self.group - 1) / self.group
        if self.kind == "all-gather":
            return share * self.result_bytes
        if self.kind == "all-reduce":
            return 2 * share * self.operand_bytes
        if self.kind == "collective-permute":
            return float(self.operand_bytes)
        return share * self.operand_bytes  # reduce-scatter, all-to-all


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(ENTRY )?(%[\w.\-]+) .*\{$")
_CALLEES = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=(%[\w.\-]+)"
    r"|branch_computations=\{([^}]*)\}"
)


def _arrays(hlo_type: str) -> list[tuple[str, int]]:
    """(dtype, bytes) of each array of an HLO type: ``f32[4,8]{1,0}`` or a tuple of them."""
    return [
        (dtype, _ITEMSIZE[dtype] * math.prod(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(hlo_type)
    ]


def _group_size(attributes: str, devices: int) -> int:
    """The replica group's size: ``{{0,4},{1,5}}``, ``[2,4]<=[8]`` or ``mesh['axis_0'=8] {...}``."""
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", attributes)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", attributes)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attributes)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
    return devices  # replica_groups={} : every device


def collectives(hlo: str, devices: int = N) -> list[Collective]:
    """Every collective of a compiled HLO module's text, with its bytes (one device's) and
    how many times one call runs it (a ``while`` body's: its known trip count; both branches
    of a conditional count). Raises ValueError for a loop of unknown trip count around one."""
    types: dict[str, str] = {}
    found: list[tuple[str, Collective]] = []  # (its computation, it)
    calls: dict[str, list[tuple[str, int | None]]] = {}  # computation -> (callee, factor)
    entry, current = None, ""
    for line in hlo.splitlines():
        c = _COMPUTATION.match(line)
        if c and " = " not in line:
            current = c.group(2)
            entry = current if c.group(1) else entry
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, result_type, op, rest = m.groups()
        types[name] = result_type
        for callee, branches in _CALLEES.findall(rest):
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
            factor = (int(trips.group(1)) if trips else None) if op == "while" else 1
            for target in [callee] if callee else re.findall(r"%[\w.\-]+", branches):
                calls.setdefault(current, []).append((target, factor))
        kind = op.removesuffix("-start")
        if kind not in KINDS:
            continue
        args, _, attributes = rest.partition(")")
        operands = [a for o in re.findall(r"%[\w.\-]+", args) for a in _arrays(types.get(o, ""))]
        result = _arrays(result_type)
        operand_bytes = sum(b for _, b in operands)
        result_bytes = sum(b for _, b in result)
        if op.endswith("-start") and len(result) > 1 and kind != "all-reduce":
            result_bytes -= operand_bytes  # an async start's tuple holds its operands too
        dtypes = tuple(sorted({d for d, _ in operands + result}))
        group = _group_size(attributes, devices)
        found.append((current, Collective(kind, operand_bytes, result_bytes, group, dtypes)))
    times: dict[str, int | None] = {}

    def visit(computation: str, factor: int | None) -> None:
        total = times.get(computation, 0)
        times[computation] = None if total is None or factor is None else total + factor
        for callee, f in calls.get(computation, []):
            visit(callee, None if factor is None or f is None else factor * f)

    if entry is not None:
        visit(entry, 1)
    out = []
    for computation, op in found:
        t = times.get(computation, 1)
        if t is None:
            raise ValueError(f"a {op.kind} in {computation} runs in a loop of unknown trip count")
        out.append(dataclasses.replace(op, times=t))
    return out


def summarize(found: list[Collective]) -> dict[str, dict[str, Any]]:
    """Per kind: executions, operand, result and ring-sent bytes (each op's times its
    executions), dtypes and group sizes."""
    out = {}
    for kind in KINDS:
        ops = [c for c in found if c.kind == kind]
        if ops:
            out[kind] = {
                "count": sum(c.times for c in ops),
                "operand_bytes": sum(c.times * c.operand_bytes for c in ops),
                "result_bytes": sum(c.times * c.result_bytes for c in ops),
                "sent_bytes": sum(c.times * c.sent for c in ops),
                "dtypes": sorted({d for c in ops for d in c.dtypes}),
                "groups": sorted({c.group for c in ops}),
            }
    return out


# ------------------------------------------------------------------------------- programs


def make_mesh(text: str | None) -> Mesh | None:
    """``"data=2,fsdp=4"`` as the programs make it (Auto axes), of the first devices."""
    if text is None:
        return None
    spec = rs.parse_mesh(text)
    n = math.prod(spec.values())
    devices = jax.devices() if jax.device_count() >= n else jax.devices("cpu")
    if len(devices) < n:
        raise SystemExit(f"--mesh {text} needs {n} devices, this process has {len(devices)}")
    return Mesh(np.array(devices[:n]).reshape(tuple(spec.values())), tuple(spec))


def device_bytes(tree: Any) -> int:
    """Bytes of ``tree``'s arrays on the first device that holds them."""
    return sum(
        x.addressable_shards[0].data.nbytes if isinstance(x, jax.Array) else x.nbytes
        for x in jax.tree.leaves(tree)
    )


@dataclasses.dataclass
class Program:
    """One program's placed state, its steps' arguments, and what its FSDP step moves."""

    mesh: Mesh | None
    parts: dict[str, Any]  # the state by part, placed
    logical: dict[str, Any]  # the same parts unsharded (arrays or ShapeDtypeStructs)
    micro: Any  # the jitted microbatch step
    micro_args: tuple
    apply: Any  # the jitted optimizer update
    apply_args: tuple
    gathered: tuple[str, ...]  # the parts every step all-gathers
    gather_dtype: Any  # what they are cast to before the gather; None: gathered as stored
    trained: str  # the part whose gradients are reduce-scattered


def trainer(
    size: Mapping[str, Any],
    *,
    optimizer: str,
    mesh: str | None,
    remat: str = "none",
    scan_layers: bool = False,
) -> Program:
    """``examples.lm.train``'s state and steps over ``mesh`` (its ``--mesh``), built as the
    trainer builds them; ``size``: ``trainer_recipe``'s model sizes and batch."""
    recipe = trainer_recipe(optimizer=optimizer, remat=remat, scan_layers=scan_layers, **size)
    plain = trainer_recipe(optimizer=optimizer, **size)  # the one-device run: unstacked
    the_mesh = make_mesh(mesh)
    spec = recipe.spec
    model = spec.create(0)
    if the_mesh is not None and "fsdp" in the_mesh.axis_names:
        # the trainer's FSDP form: gathered, and reduce-scattered, in fp32
        model = rm.shard(model, rs.ShardingContext(the_mesh, "fsdp"), compute_dtype=jnp.float32)
    graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    place = lambda tree: tree if the_mesh is None else rs.place(tree, the_mesh)
    params, rngs, rest = place((params, rngs, rest))
    tx = recipe.optimizer.build(the_mesh, stacked=scan_layers)
    opt_state = place(jax.jit(tx.init)(params))
    init_acc = jax.jit(ro.GradientAccumulator.init, static_argnums=1)
    acc = place(init_acc(params, jnp.float32))
    loss = functools.partial(rm.next_token_loss_sum, chunk=spec.loss_chunk)
    run = rs.make_train_steps(graphdef, tx, loss, mesh=the_mesh, donate=True)
    sharding = None if the_mesh is None else rs.batch_sharding(the_mesh)
    shape = (recipe.batch_size, spec.seq_len + 1)
    batch = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)

    logical = nnx.state(nnx.eval_shape(lambda: plain.spec.create(0)), nnx.Param)
    fp32 = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), t)
    logical_opt = jax.eval_shape(plain.optimizer.build().init, logical)
    logical_acc = jax.eval_shape(lambda p: ro.GradientAccumulator.init(p, jnp.float32), logical)
    return Program(
        mesh=the_mesh,
        parts={"params": params, "fp32 masters": _masters(opt_state),
               "optimizer state": _without_masters(opt_state), "accumulator": acc},
        logical={"params": logical, "fp32 masters": fp32(logical),
                 "optimizer state": _without_masters(logical_opt), "accumulator": logical_acc},
        micro=run.micro, micro_args=(params, rngs, acc, rest, batch),
        apply=run.apply, apply_args=(params, opt_state, acc),
        gathered=("params",),
        gather_dtype=jnp.float32,  # the trainer's FSDP form: gathered and reduced in fp32
        trained="params",
    )  # fmt: skip


def _masters(opt_state: Any) -> list[Any]:
    is_master = lambda s: isinstance(s, ro.Fp32MasterState)
    return [s.master for s in jax.tree.leaves(opt_state, is_leaf=is_master) if is_master(s)]


def _without_masters(opt_state: Any) -> Any:
    is_master = lambda s: isinstance(s, ro.Fp32MasterState)
    return jax.tree.map(
        lambda s: s._replace(master=None) if is_master(s) else s, opt_state, is_leaf=is_master
    )


def tiny_base(out: Path, args: argparse.Namespace) -> Path:
    """A random Llama of the benchmark's sizes saved as an HF directory, as the fine-tuning
    tests' ``tiny_base`` saves theirs (fp32, untied head, half as many KV heads), without a
    tokenizer (the steps take token ids)."""
    config = rm.LlamaConfig.tiny(
        args.vocab_size,
        hidden_size=args.d_model,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=max(1, args.n_heads // 2),
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
        param_dtype=jnp.float32,
        eos_token_id=0,
    )
    rm.save_pretrained(rm.LlamaForCausalLM(config, rngs=nnx.Rngs(0)), out)
    return out


FINETUNE_PARTS = ("NF4 codes", "NF4 scales", "base rest", "adapters")


def _finetune_parts(model: rm.LlamaForCausalLM) -> dict[str, list[Any]]:
    """The model's arrays by part, sharded or not: the NF4 codes, their scales (absmax and its
    double quantization), the rest of the base (embedding, norms, head) and the adapters."""
    names: dict[int, str] = {}  # a sharded layer's variables, by their attribute name
    for _, node in nnx.iter_graph(model):
        if isinstance(node, rs.ShardedModule):
            for path, var in zip(node.paths, node.variables, strict=True):
                names[id(var)] = str(path[-1])
    parts: dict[str, list[Any]] = {name: [] for name in FINETUNE_PARTS}
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Variable) or isinstance(var, nnx.RngState):
            continue
        if isinstance(var, rl.LoRAParam):
            part = "adapters"
        elif isinstance(var, rl.Quantized):
            part = "NF4 codes" if names.get(id(var), str(path[-1])) == "codes" else "NF4 scales"
        else:
            part = "base rest"
        parts[part].append(var.get_value())
    return parts


def finetuner(base_dir: Path, args: argparse.Namespace, *, mesh: str | None) -> Program:
    """``examples.finetune``'s QLoRA state and steps (``examples/finetune/mesh.py``'s over a
    mesh)."""
    the_mesh = make_mesh(mesh)
    model = rm.from_pretrained(base_dir, param_dtype=jnp.bfloat16, dtype=jnp.float32,
                               quantize="nf4")  # fmt: skip
    rl.apply_lora(model, list(rm.PROJECTIONS), rank=args.rank, alpha=2.0 * args.rank,
                  dropout=0.0, rngs=nnx.Rngs(0))  # fmt: skip
    logical = _finetune_parts(model)
    trained = model
    if the_mesh is not None and "fsdp" in the_mesh.axis_names:
        trained = rm.shard(model, rs.ShardingContext(the_mesh, "fsdp"))
    trained.eval()
    eval_def = nnx.graphdef(trained)
    trained.train()
    graphdef, adapters, rngs, base = nnx.split(trained, rl.LoRAParam, nnx.RngState, ...)
    # examples.finetune's optimizer (its schedule changes no shape)
    tx = optax.chain(ro.clip_by_global_norm(1.0), ro.adamw(1e-3, weight_decay=0.0))
    opt_state = tx.init(adapters)
    acc = ro.GradientAccumulator.init(adapters, jnp.float32)
    steps = rs.make_train_steps(
        graphdef, tx, rm.causal_lm_loss_sum, mesh=the_mesh, eval_graphdef=eval_def
    )
    micro, apply = steps.micro, steps.apply
    sharding = None
    if the_mesh is not None:
        adapters, rngs, base = rs.place((adapters, rngs, base), the_mesh)
        opt_state, acc = rs.place((opt_state, acc), the_mesh)
        sharding = rs.batch_sharding(the_mesh)
    shape = (args.batch_size, args.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
             for k in ("tokens", "labels", "segment_ids", "positions")}  # fmt: skip
    parts: dict[str, Any] = _finetune_parts(nnx.merge(graphdef, adapters, rngs, base))
    parts["AdamW moments"] = opt_state
    logical["AdamW moments"] = jax.eval_shape(tx.init, logical["adapters"])
    return Program(
        mesh=the_mesh, parts=parts, logical=logical,
        micro=micro, micro_args=(adapters, rngs, acc, base, batch),
        apply=apply, apply_args=(adapters, opt_state, acc),
        gathered=FINETUNE_PARTS, gather_dtype=None, trained="adapters",
    )  # fmt: skip


def state_bytes(program: Program) -> dict[str, int]:
    """Each part's bytes on one device."""
    return {name: device_bytes(tree) for name, tree in program.parts.items()}


def traffic(program: Program, steps: Sequence[str] = ("micro", "apply")) -> dict[str, Any]:
    """``{step: summarize(...)}`` of the compiled steps' collectives."""
    out = {}
    for step in steps:
        fn, fn_args = {"micro": (program.micro, program.micro_args),
                       "apply": (program.apply, program.apply_args)}[step]  # fmt: skip
        out[step] = summarize(collectives(fn.lower(*fn_args).compile().as_text()))
    return out


# ------------------------------------------------------------------------------- analytic


def _itemsize(dtype: Any, *, cpu: bool) -> int:
    """Bytes per element a collective moves; ``cpu``: XLA:CPU's, which runs 16-bit floats in
    f32 (it converts around the collective)."""
    dtype = jnp.dtype(dtype)
    if cpu and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2:
        return 4
    return dtype.itemsize


def padded_bytes(tree: Any, fsdp: int, dtype: Any = None, *, cpu: bool = False) -> int:
    """Bytes of ``tree``'s leaves, each padded to a multiple of ``fsdp`` elements (a
    ``ShardedParameter``'s storage, whole), in ``dtype`` (None: each leaf's own)."""
    return sum(
        -(-math.prod(x.shape) // fsdp) * fsdp * _itemsize(dtype or x.dtype, cpu=cpu)
        for x in jax.tree.leaves(tree)
    )


def analytic_micro(program: Program, *, data: int, fsdp: int, cpu: bool) -> dict[str, float]:
    """FSDP's bytes per device for one microbatch: each kind's operand bytes, an all-gather's
    by its result (the gathered parameters).

    ``all-gather``: every gathered part, padded, once: the forward's copy kept for the
    backward (``all-gather x2``: gathered again in the backward). ``reduce-scatter``: the
    trained part's fp32 gradients, padded. ``all-reduce``: over ``data``, their shards.
    """
    gathered = sum(
        padded_bytes(program.logical[k], fsdp, program.gather_dtype, cpu=cpu)
        for k in program.gathered
    )
    grads = padded_bytes(program.logical[program.trained], fsdp, jnp.float32)
    return {
        "all-gather": float(gathered),
        "all-gather x2": 2.0 * gathered,
        "reduce-scatter": float(grads),
        "all-reduce": grads / fsdp if data > 1 else 0.0,
    }


def analytic_muon(params: Any, fsdp: int, *, cpu: bool) -> float:
    """``fsdp_muon``'s all-to-all bytes per update: per matrix shape, its matrices dealt to
    the devices in rounds of ``fsdp``, each round's shards sent in bf16, the results back."""
    counts: dict[tuple[int, ...], int] = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        key = jax.tree_util.keystr(path)  # the trainer's split: the tables go to AdamW
        if x.ndim == 2 and not key.startswith(("['model']['embed_tokens']", "['lm_head']")):
            counts[x.shape] = counts.get(x.shape, 0) + 1
    item = _itemsize(jnp.bfloat16, cpu=cpu)
    rounds = lambda shape, n: -(-n // fsdp) * fsdp * -(-math.prod(shape) // fsdp) * item
    return 2.0 * sum(rounds(s, n) for s, n in counts.items())


# ------------------------------------------------------------------------------- tables


def _mib(b: float) -> str:
    return f"{b / MiB:.3f}"


def bytes_table(one: dict[str, int], logical: dict[str, Any], by_fsdp: dict[int, dict]) -> str:
    """Markdown: each part's MiB per device, one device and each F, as x of one device's / F
    and, after ``pad``, ``rudax.sharding.bytes_per_device``'s padded figure as x of the same."""
    head = "| part | 1 device MiB |" + "".join(
        f" fsdp={f} MiB (x of 1/{f}; pad) |" for f in by_fsdp
    )
    lines = [head, "|---|---:|" + "---:|" * len(by_fsdp)]
    for part, whole in [*one.items(), ("**total**", sum(one.values()))]:
        row = f"| {part} | {_mib(whole)} |"
        for f, got in by_fsdp.items():
            ideal = whole / f
            mine = sum(got.values()) if part == "**total**" else got[part]
            trees = list(logical.values()) if part == "**total**" else logical[part]
            pad = rs.bytes_per_device(trees, f)
            row += f" {_mib(mine)} (x{mine / ideal:.4f}; x{pad / ideal:.4f}) |"
        lines.append(row)
    return "\n".join(lines)


def traffic_table(rows: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per arm, step and collective kind."""
    lines = [
        "| arm | step | collective | ops | dtype | group | operand MiB | result MiB "
        "| ring-sent MiB | analytic MiB | analytic, XLA:CPU dtypes | measured / analytic (CPU) |",
        "|---|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, r in rows.items():
        for step, summary in r["traffic"].items():
            analytic, on_cpu = r["analytic"][step], r["analytic_cpu"][step]
            kinds = [k for k in KINDS if k in summary or analytic.get(k)]
            for kind in kinds or ["(none)"]:
                s = summary.get(kind)
                a, c = analytic.get(kind), on_cpu.get(kind)
                # an all-gather by what it gathers, the others by what they are given
                got = (
                    (s["result_bytes"] if kind == "all-gather" else s["operand_bytes"]) if s else 0
                )
                vs = f"{got / c:.3f}" if c else "-"
                if kind == "all-gather" and c:
                    vs += f" (x2 rule: {got / on_cpu['all-gather x2']:.3f})"
                cells = (
                    [str(s["count"]), "/".join(s["dtypes"]), "/".join(map(str, s["groups"])),
                     _mib(s["operand_bytes"]), _mib(s["result_bytes"]), _mib(s["sent_bytes"])]
                    if s else ["0", "-", "-", "0", "0", "0"]
                )  # fmt: skip
                cells += ["-" if a is None else _mib(a), "-" if c is None else _mib(c), vs]
                lines.append(f"| {arm} | {step} | {kind} | {' | '.join(cells)} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- main

# (name, trainer keywords, steps compiled): the optimizer enters only the update, so Muon's
# microbatch step is AdamW's; remat changes only the microbatch step.
TRAINER_ARMS = (
    ("adamw", dict(optimizer="adamw"), ("micro", "apply")),
    ("muon", dict(optimizer="muon"), ("apply",)),
    ("adamw --remat full", dict(optimizer="adamw", remat="full"), ("micro",)),
    ("adamw --remat full --scan-layers", dict(optimizer="adamw", remat="full", scan_layers=True),
     ("micro",)),
)  # fmt: skip


def _analytic(program: Program, mesh: str, optimizer: str, *, cpu: bool) -> dict[str, dict]:
    spec = rs.parse_mesh(mesh)
    data, fsdp = spec.get("data", 1), spec.get("fsdp", 1)
    micro = analytic_micro(program, data=data, fsdp=fsdp, cpu=cpu)
    apply = {}
    if optimizer == "muon":
        apply["all-to-all"] = analytic_muon(program.logical["params"], fsdp, cpu=cpu)
    return {"micro": micro, "apply": apply}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per microbatch")
    parser.add_argument("--rank", type=int, default=8, help="the fine-tuner's LoRA rank")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    if max(jax.device_count(), len(jax.devices("cpu"))) < N:
        raise SystemExit(f"needs {N} devices, got {jax.devices()}: JAX started before this set 8")
    size = dict(
        hidden_size=args.d_model, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, vocab_size=args.vocab_size, seq_len=args.seq_len,
        batch_size=args.batch_size,
    )  # fmt: skip
    sizes = {4: MESHES[0], 8: MESHES[1]}  # data replicas hold what fsdp=4 alone would
    state: dict[str, Any] = {}
    rows: dict[str, Any] = {}

    def measure(name: str, build: Any) -> None:
        one = build(mesh=None)
        by_fsdp = {f: state_bytes(build(mesh=mesh)) for f, mesh in sizes.items()}
        state[name] = {"one": state_bytes(one), "logical": one.logical, "by_fsdp": by_fsdp}

    def record(name: str, program: Program, mesh: str, optimizer: str, steps: Sequence[str]):
        rows[name] = {
            "traffic": traffic(program, steps),
            "analytic": _analytic(program, mesh, optimizer, cpu=False),
            "analytic_cpu": _analytic(program, mesh, optimizer, cpu=True),
        }

    # --------------------------------------------------------------------------- trainer
    for optimizer in ("adamw", "muon"):
        measure(f"trainer, {optimizer}", functools.partial(trainer, size, optimizer=optimizer))
    for mesh in MESHES:
        for name, kw, steps in TRAINER_ARMS:
            program = trainer(size, mesh=mesh, **kw)
            record(f"trainer {name}, {mesh}", program, mesh, kw["optimizer"], steps)

    # --------------------------------------------------------------------------- fine-tuner
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = tiny_base(Path(tmp) / "hf", args)
        build = functools.partial(finetuner, base_dir, args)
        measure(f"fine-tuner, QLoRA rank {args.rank}", build)
        for mesh in MESHES:
            record(f"fine-tuner, {mesh}", build(mesh=mesh), mesh, "adamw", ("micro", "apply"))

    # --------------------------------------------------------------------------- report
    n_params = sum(x.size for x in jax.tree.leaves(state["trainer, adamw"]["logical"]["params"]))
    print(
        f"jax {jax.__version__}, {N} simulated {jax.devices()[0].platform} devices; Llama "
        f"d_model {args.d_model}, {args.n_layers} layers, {args.n_heads} heads, vocab "
        f"{args.vocab_size}: {n_params:,} parameters (the fine-tuner's base: untied head, "
        f"{max(1, args.n_heads // 2)} KV heads); batch {args.batch_size} x {args.seq_len}; "
        f"QLoRA rank {args.rank} on every projection, dropout 0\n"
    )
    for name, s in state.items():
        print(f"### Bytes per device: {name}\n")
        print(bytes_table(s["one"], s["logical"], s["by_fsdp"]) + "\n")
    print("### Collectives per device and call, from the compiled HLO\n")
    print(traffic_table(rows))
    results = {
        "args": vars(args),
        "bytes": {
            n: {"one_device": s["one"], "per_device": s["by_fsdp"]} for n, s in state.items()
        },
        "collectives": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
