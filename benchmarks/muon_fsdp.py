"""Muon under FSDP: rudax.sharding.fsdp_muon against AdamW on the same shards, 8 simulated devices.

The model is a small ``rudax.models.LlamaForCausalLM`` (``LlamaConfig.tiny`` at the flags'
sizes, fp32 storage, tied embedding) sharded over ``fsdp=8`` by ``rudax.models.shard``: every
parameter a flat, padded ``ShardedParameter``, 1/8 on each device. Each arm is the
optimizer's update alone (``tx.update`` and ``optax.apply_updates`` in one ``jax.jit``,
parameters and state donated), on fixed gradients:

- ``AdamW, FSDP x8``: ``rudax.optim.adamw`` on the shards, elementwise, no communication;
- ``Muon, FSDP x8``: ``rudax.sharding.fsdp_muon`` (Muon on the blocks' matrices, AdamW on the
  embedding and norms, as the trainer splits them): each device orthogonalizes whole about
  1/8 of the matrices, gathered and returned by two ``all_to_all``s;
- ``Muon, 1 device``: ``rudax.optim.muon`` on the whole parameters on one device, every
  matrix orthogonalized there (the reference the first update is checked against);
- ``Muon, replicated x8``: ``rudax.optim.muon`` on whole parameters replicated on the 8
  devices (a data-only mesh, the trainer's Muon before this): no communication, every
  device orthogonalizes every matrix and holds the whole state.

Arms are timed in alternating rounds (``benchmarks._timing``); the table gives median ms per
update and the per-round ratio to AdamW FSDP, median [min, max]. ``moved`` is what one
device's compiled program sends into collectives: the operand bytes of its all-gather,
all-to-all, reduce-scatter, all-reduce and collective-permute instructions in
``jit(...).lower(...).compile().as_text()`` (what it sends: an all-gather's operand is its
shard, an all-to-all's its whole buffer). XLA:CPU runs a bf16 collective in f32, converting
around it, so the all-to-all of bf16 Newton-Schulz inputs counts 4 bytes an element here
where a GPU's moves 2. ``NS GFLOP`` is the matmul flops of that
program (per device; Newton-Schulz is all of them). ``state/dev`` is the optimizer state's
bytes on device 0, and its ratio to the one-device state. For scale, the line under the
table gives the same collective bytes for the FSDP train step's forward and backward (the
parameters' all-gathers and the gradients' reduce-scatters).

The 8 devices are simulated on the host CPU and share its cores, so dividing Newton-Schulz
over them does not make it faster here: the total work is the same (about one device's, a
little more for the rounds' leftovers). On 8 accelerators each device's share runs in
parallel; what this machine shows is the program each device runs and what it moves.

    python -m benchmarks.muon_fsdp                      # 4 layers, width 128, ~1 min
    python -m benchmarks.muon_fsdp --layers 8 --d-model 256 --rounds 7
"""

from __future__ import annotations

import os

# Before jax is imported: the device count is fixed when the CPU backend starts.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import math
import re
import statistics
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.optim as ro
import rudax.sharding as rs
from benchmarks._timing import alternate, ratio_summary
from rudax.models import LlamaConfig, LlamaForCausalLM, causal_lm_loss_sum, shard

N = 8
COLLECTIVES = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")
_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s8": 1,
          "u8": 1, "pred": 1}  # fmt: skip


def _is_sp(x: Any) -> bool:
    return isinstance(x, rs.ShardedParameter)


def _type_bytes(text: str) -> int:
    """Bytes of an HLO type: ``f32[4,8]{1,0}``, or the sum over a tuple's elements."""
    return sum(
        _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in re.findall(
            r"\b(f64|f32|bf16|f16|s64|s32|u32|s8|u8|pred)\[([\d,]*)\]", text
        )
    )


def hlo_traffic(hlo: str) -> dict[str, float]:
    """One device's collective operand bytes by kind, and its matmul flops, from HLO text."""
    types: dict[str, str] = {}
    moved = dict.fromkeys(COLLECTIVES, 0)
    flops = 0
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            types = {f"%{n}": t for n, t in re.findall(r"(\S+): (\S+\[[\d,]*\])", line)}
            continue
        m = re.match(r"\s*(?:ROOT )?(%\S+) = (\(.*?\)|\S+) ([\w-]+)\((.*)", line)
        if not m:
            continue
        name, type_, op, rest = m.groups()
        types[name] = type_
        operands = re.findall(r"%[\w.\-]+", rest.split(")")[0])
        kind = op.removesuffix("-start")
        if kind in moved:
            moved[kind] += sum(_type_bytes(types.get(o, "")) for o in operands)
        elif op == "dot":
            dims = lambda t: [
                int(d) for d in re.search(r"\[([\d,]*)\]", t).group(1).split(",") if d
            ]
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
            lhs = dims(types[operands[0]])
            k = math.prod(lhs[int(c)] for c in contracting.split(",") if c)
            flops += 2 * math.prod(dims(type_)) * k
    return {**{k: float(v) for k, v in moved.items()}, "flops": float(flops)}


def _matrices(params: Any) -> Any:
    """The trainer's Muon leaves: the blocks' matrices, not the (tied) embedding table."""

    def pick(path: Any, x: Any) -> bool:
        rank = len(x.logical_shape) if _is_sp(x) else x.ndim
        key = jax.tree_util.keystr(path)
        return rank == 2 and not key.startswith(("['lm_head']", "['model']['embed_tokens']"))

    return jax.tree_util.tree_map_with_path(pick, params, is_leaf=_is_sp)


def _state_bytes(state: Any) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--ns-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--iters", type=int, default=3, help="updates per arm per round")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    if jax.device_count() < N:
        raise SystemExit(f"needs {N} devices, got {jax.devices()}; unset XLA_FLAGS/JAX_PLATFORMS")

    config = LlamaConfig.tiny(
        args.vocab, hidden_size=args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, max_position_embeddings=64, param_dtype=jnp.float32,
    )  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("fsdp",))
    sharded = shard(model, rs.ShardingContext(mesh, "fsdp"))
    graph, params, rest = nnx.split(sharded, nnx.Param, ...)
    full = jax.tree.map(lambda x: jnp.asarray(x.unshard()), params, is_leaf=_is_sp)
    rng = np.random.default_rng(0)
    grads_full = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), full)
    grads = jax.tree.map(
        lambda g, p: rs.ShardedParameter.from_full(g, mesh, "fsdp"), grads_full, params,
        is_leaf=_is_sp,
    )  # fmt: skip
    mask = _matrices(params)
    muon_kw = dict(muon_mask=mask, mask=mask, adamw_learning_rate=1e-3,
                   ns_dtype=jnp.dtype(args.ns_dtype))  # fmt: skip
    replicated = NamedSharding(mesh, P())

    def arm(tx: optax.GradientTransformation, p: Any, g: Any, *, on_mesh: bool) -> dict:
        state = tx.init(p)
        if on_mesh:  # the step counts replicated, as the update returns them
            state = jax.tree.map(lambda x: x if x.ndim else jax.device_put(x, replicated), state)

        def update(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        step = jax.jit(update, donate_argnums=(0, 1))
        hlo = jax.jit(update).lower(p, state, g).compile().as_text()
        holder = {"p": jax.tree.map(jnp.copy, p), "s": state}

        def run():
            holder["p"], holder["s"] = step(holder["p"], holder["s"], g)
            return holder["p"]

        return {"run": run, "traffic": hlo_traffic(hlo), "state_bytes": _state_bytes(state),
                "holder": holder, "step": step}  # fmt: skip

    arms = {
        "AdamW, FSDP x8": arm(ro.adamw(1e-3, weight_decay=0.1, mask=mask), params, grads,
                              on_mesh=True),
        "Muon, FSDP x8": arm(rs.fsdp_muon(0.02, mesh=mesh, **muon_kw), params, grads,
                             on_mesh=True),
        "Muon, 1 device": arm(ro.muon(0.02, **muon_kw), full, grads_full, on_mesh=False),
        "Muon, replicated x8": arm(ro.muon(0.02, **muon_kw), jax.device_put(full, replicated),
                                   jax.device_put(grads_full, replicated), on_mesh=True),
    }  # fmt: skip
    one_device_adamw = _state_bytes(ro.adamw(1e-3).init(full))

    # The first update of each Muon arm, compared: the table times one computation. bf16
    # Newton-Schulz may round differently in the two programs: one bf16 ulp of lr * r.
    for name in ("Muon, FSDP x8", "Muon, 1 device"):
        arms[name]["run"]()
    got = jax.tree.leaves(
        jax.tree.map(lambda x: x.unshard(), arms["Muon, FSDP x8"]["holder"]["p"], is_leaf=_is_sp)
    )
    want = jax.tree.leaves(arms["Muon, 1 device"]["holder"]["p"])
    diff = lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    worst = max(diff(a, b) for a, b in zip(got, want, strict=True))
    limit = 0.02 * 2.0 * 2**-7 if args.ns_dtype == "bfloat16" else 1e-5
    if worst > limit:
        raise SystemExit(f"Muon FSDP's first update differs from one device's by {worst:.3g}")

    # For scale: the FSDP train step's own collectives (forward and backward).
    batch = {
        "tokens": rng.integers(0, args.vocab, (N, 32)),
        "labels": rng.integers(0, args.vocab, (N, 32)),
    }

    def loss(p, b):
        local = lambda p, r, b: causal_lm_loss_sum(nnx.merge(graph, p, r), b)[0][None]
        specs = (rs.shard_specs(p), rs.shard_specs(rest), P("fsdp"))
        return jnp.sum(
            jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("fsdp"))(p, rest, b)
        )

    step_hlo = jax.jit(jax.grad(loss)).lower(params, batch).compile().as_text()
    step_moved = sum(v for k, v in hlo_traffic(step_hlo).items() if k != "flops")

    times = alternate({n: a["run"] for n, a in arms.items()}, rounds=args.rounds, iters=args.iters)
    base = "AdamW, FSDP x8"
    n_params = sum(x.size for x in jax.tree.leaves(full))
    n_muon = sum(
        math.prod(x.shape)
        for x, m in zip(jax.tree.leaves(full), jax.tree.leaves(mask), strict=True)
        if m
    )
    print(
        f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].platform}; Llama "
        f"{args.layers} layers, d_model {args.d_model}, vocab {args.vocab}: {n_params:,} fp32 "
        f"parameters, {n_muon:,} in {sum(jax.tree.leaves(mask))} Muon matrices; Newton-Schulz "
        f"in {args.ns_dtype}; {args.rounds} alternating rounds x {args.iters} updates"
    )
    print(f"first update, Muon FSDP vs one device: max |diff| {worst:.2e}\n")
    print(
        f"{'arm':<20} {'ms/update':>10} {'time vs AdamW FSDP':>24} {'moved MiB':>10} "
        f"{'all-to-all':>10} {'NS GFLOP':>9} {'state/dev MiB':>14} {'vs 1 dev':>9}"
    )
    results: dict[str, Any] = {"arms": {}}
    for name, a in arms.items():
        r, lo, hi = ratio_summary(times[name], times[base])
        t = a["traffic"]
        moved = sum(t[k] for k in COLLECTIVES)
        one_dev = arms["Muon, 1 device"]["state_bytes"] if "Muon" in name else one_device_adamw
        print(
            f"{name:<20} {statistics.median(times[name]) * 1e3:>10.2f} "
            f"{f'{r:.3f}x [{lo:.3f}, {hi:.3f}]':>24} {moved / 2**20:>10.3f} "
            f"{t['all-to-all'] / 2**20:>10.3f} {t['flops'] / 1e9:>9.3f} "
            f"{a['state_bytes'] / 2**20:>14.3f} {a['state_bytes'] / one_dev:>9.3f}"
        )
        results["arms"][name] = {
            "ms_per_update": statistics.median(times[name]) * 1e3,
            "time_vs_adamw_fsdp": [r, lo, hi],
            "moved_bytes": moved,
            "traffic": t,
            "state_bytes_per_device": a["state_bytes"],
            "state_vs_one_device": a["state_bytes"] / one_dev,
        }
    r, lo, hi = ratio_summary(times["Muon, FSDP x8"], times["Muon, 1 device"])
    print(f"\nMuon FSDP x8 / Muon 1 device time: {r:.3f}x [{lo:.3f}, {hi:.3f}] (shared CPU cores)")
    print(
        f"the FSDP train step's forward+backward moves {step_moved / 2**20:.3f} MiB per device "
        f"(all-gathers, reduce-scatters); Muon's update adds "
        f"{results['arms']['Muon, FSDP x8']['moved_bytes'] / 2**20:.3f} MiB"
    )
    compiles = {name: a["step"]._cache_size() for name, a in arms.items()}
    if any(c != 1 for c in compiles.values()):
        raise SystemExit(f"an update compiled more than once: {compiles}")
    results.update(step_moved_bytes=step_moved, max_abs_diff_first_update=worst)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
