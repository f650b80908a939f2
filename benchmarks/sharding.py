"""Sharding benchmark: one device vs DataParallel vs FSDP on a tiny GPT, on 8 simulated devices.

The same small decoder (embedding tied to the LM head, RMSNorm, causal attention built from
``rudax.layers.Linear``, GatedMLP) is trained with ``rudax.optim.adamw`` in three arms:

- single device: the whole batch in one plain ``jax.jit`` step;
- DataParallel: parameters and optimizer state replicated on 8 devices, the batch sharded,
  each rank's gradient of its local masked loss *sum* averaged by ``DataParallel.reduce`` with
  its token count as weight (ranks hold unequal token counts);
- FSDP: the model converted by ``ShardingContext``, every parameter a flat ``ShardedParameter``
  holding 1/8 on each device, AdamW running on the shards.

Each arm is one jitted step with parameters and optimizer state donated. The first step's
losses are checked to agree (the table compares one computation), then the arms are timed in
alternating rounds (``benchmarks._timing``): median ms per step and the per-round time ratio
to the single device, median [min, max]. Memory is the bytes of parameters + optimizer state
on device 0 (``addressable_shards[0]`` of every leaf), and its ratio to the single device:
DP about 1, FSDP about 1/8 (plus padding and the replicated step count).

The 8 devices are simulated on the host CPU (``--xla_force_host_platform_device_count=8``)
and share its cores: the 8 device programs run in parallel threads where the one-device
program may not use every core, so the time ratios say what the sharded programs and their
collectives cost on this machine, not what 8 real accelerators would gain.

    python -m benchmarks.sharding                          # defaults, well under 2 min on CPU
    python -m benchmarks.sharding --layers 4 --d-model 256 --batch 32 --rounds 9
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
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.layers as rl
import rudax.optim as ro
import rudax.sharding as rs
from benchmarks._timing import alternate, ratio_summary

N = 8


def build_model(args) -> dict:
    """A flat {name: module} decoder; a flat dict keeps the FSDP conversion one line per kind."""
    rngs = nnx.Rngs(0)
    d = args.d_model
    mods = {"embed": rl.Embedding(args.vocab, d, rngs=rngs)}
    for i in range(args.layers):
        mods[f"norm1_{i}"] = rl.RMSNorm(d, impl="xla")
        for name in "qkvo":
            mods[f"{name}_{i}"] = rl.Linear(d, d, use_bias=False, rngs=rngs)
        mods[f"norm2_{i}"] = rl.RMSNorm(d, impl="xla")
        mods[f"mlp_{i}"] = rl.GatedMLP(d, 4 * d, impl="xla", rngs=rngs)
    mods["norm_f"] = rl.RMSNorm(d, impl="xla")
    mods["head"] = rl.TiedProjection(mods["embed"])
    return mods


def shard_model(ctx: rs.ShardingContext, mods: dict) -> dict:
    def convert(name, m):
        if name == "head":  # the same ShardedParameter as the embedding: one shard, one leaf
            return ctx.tied_projection(mods["embed"])
        if isinstance(m, rl.Embedding):
            return ctx.embedding(m)
        if isinstance(m, rl.RMSNorm):
            return ctx.rms_norm(m)
        if isinstance(m, rl.GatedMLP):
            return ctx.gated_mlp(m)
        return ctx.linear(m)

    return {name: convert(name, m) for name, m in mods.items()}


def forward(m, ids_BxT, *, layers: int, heads: int):
    x = m["embed"](ids_BxT)
    t, d = x.shape[1], x.shape[2]
    causal = jnp.tril(jnp.ones((t, t), bool))
    for i in range(layers):
        h = m[f"norm1_{i}"](x)
        split = lambda y: y.reshape(*y.shape[:-1], heads, d // heads)
        q, k, v = (split(m[f"{n}_{i}"](h)) for n in "qkv")
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(jnp.float32(d // heads))
        scores = jnp.where(causal, scores, jnp.array(-jnp.inf, scores.dtype))
        att = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
        x = x + m[f"o_{i}"](att.reshape(*att.shape[:2], d))
        x = x + m[f"mlp_{i}"](m[f"norm2_{i}"](x))
    return m["head"](m["norm_f"](x))


def masked_nll_sum(m, ids_BxT1, mask_BxT, **kw):
    """Sum over the valid tokens of the next-token negative log-likelihood."""
    logits = forward(m, ids_BxT1[:, :-1], **kw)
    logp = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    nll = -jnp.take_along_axis(logp, ids_BxT1[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(mask_BxT * nll)


def device0_bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def single_arm(mods, tx, ids, mask, kw):
    graph, params = nnx.split(nnx.Dict(mods))

    def step(params, opt_state, ids, mask):
        loss_fn = lambda p: masked_nll_sum(nnx.merge(graph, p), ids, mask, **kw) / jnp.sum(mask)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), params, tx.init(params), (ids, mask)


def dp_arm(mods, tx, mesh, ids, mask, kw):
    dp = rs.DataParallel(mesh, "data")
    graph, params = nnx.split(nnx.Dict(mods))
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)

    def body(params, opt_state, ids, mask):
        loss_fn = lambda p: masked_nll_sum(nnx.merge(graph, p), ids, mask, **kw)
        # The params are replicated: shard_map already sums their gradient over the ranks,
        # and reduce() then only divides by the global token count.
        loss_sum, grads = jax.value_and_grad(loss_fn)(params)
        tokens = jnp.sum(mask)
        grads = dp.reduce(grads, tokens)  # global gradient sum / global token count
        updates, opt_state = tx.update(grads, opt_state, params)
        loss = jax.lax.psum(loss_sum, "data") / jax.lax.psum(tokens, "data")
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=(P(), P(), P()),
    )
    batch = NamedSharding(mesh, P("data"))
    data = (jax.device_put(ids, batch), jax.device_put(mask, batch))
    return jax.jit(step, donate_argnums=(0, 1)), params, opt_state, data


def fsdp_arm(mods, tx, mesh, ids, mask, kw):
    sharded = shard_model(rs.ShardingContext(mesh, "fsdp"), mods)
    graph, params = nnx.split(nnx.Dict(sharded))

    def local_loss(p, ids, mask):
        # Every rank divides by the global count: the sum of the local losses is the mean.
        total = jax.lax.psum(jnp.sum(mask), "fsdp")
        return (masked_nll_sum(nnx.merge(graph, p), ids, mask, **kw) / total)[None]

    local = jax.shard_map(local_loss, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))

    def step(params, opt_state, ids, mask):
        loss, grads = jax.value_and_grad(lambda p: jnp.sum(local(p, ids, mask)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)  # elementwise, on the shards
        return optax.apply_updates(params, updates), opt_state, loss

    # tx.init puts the step count on one device; replicated, as the step returns it, the
    # second call reuses the first compilation.
    replicated = NamedSharding(mesh, P())
    opt_state = jax.tree.map(
        lambda v: v if isinstance(v.sharding, NamedSharding) else jax.device_put(v, replicated),
        tx.init(params),
    )
    batch = NamedSharding(mesh, P("fsdp"))
    data = (jax.device_put(ids, batch), jax.device_put(mask, batch))
    return jax.jit(step, donate_argnums=(0, 1)), params, opt_state, data


def make_runner(step, params, opt_state, data):
    holder = {"p": params, "s": opt_state}

    def run():
        holder["p"], holder["s"], loss = step(holder["p"], holder["s"], *data)
        return loss

    return holder, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch, divisible by 8")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--iters", type=int, default=3, help="steps per arm per round")
    args = parser.parse_args()
    if args.batch % N or args.d_model % args.heads:
        parser.error(f"--batch must divide by {N} and --d-model by --heads, got {args}")
    if jax.device_count() < N:
        raise SystemExit(f"needs {N} devices, got {jax.devices()}; unset XLA_FLAGS/JAX_PLATFORMS")

    kw = dict(layers=args.layers, heads=args.heads)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, args.vocab, (args.batch, args.seq + 1)), jnp.int32)
    # Each sequence keeps a random prefix of at least half its tokens: unequal counts per rank.
    valid = rng.integers(args.seq // 2, args.seq + 1, args.batch)
    mask = jnp.asarray(np.arange(args.seq)[None, :] < valid[:, None], jnp.float32)
    tx = ro.adamw(1e-3, weight_decay=0.1)
    devices = np.array(jax.devices()[:N])
    arms = {
        "single device": single_arm(build_model(args), tx, ids, mask, kw),
        "DataParallel x8": dp_arm(
            build_model(args), tx, jax.sharding.Mesh(devices, ("data",)), ids, mask, kw
        ),
        "FSDP x8": fsdp_arm(
            build_model(args), tx, jax.sharding.Mesh(devices, ("fsdp",)), ids, mask, kw
        ),
    }
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.Dict(build_model(args)))))
    mem = {name: device0_bytes((a[1], a[2])) for name, a in arms.items()}
    holders, runs = {}, {}
    for name, arm in arms.items():
        holders[name], runs[name] = make_runner(*arm)

    print(
        f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].platform}; "
        f"{n_params:,} parameters ({args.layers} layers, d_model {args.d_model}, vocab "
        f"{args.vocab}, tied head), batch {args.batch} x seq {args.seq}, "
        f"{int(mask.sum())} tokens; {args.rounds} alternating rounds x {args.iters} steps"
    )
    first = {name: float(run()) for name, run in runs.items()}  # compiles each arm
    print("first-step loss: " + ", ".join(f"{n} {v:.7f}" for n, v in first.items()))
    ref = first["single device"]
    for name, v in first.items():
        if not np.isclose(v, ref, rtol=1e-5, atol=0):
            raise SystemExit(f"{name}'s first-step loss {v!r} differs from one device's {ref!r}")

    times = alternate(runs, rounds=args.rounds, iters=args.iters)
    base = "single device"
    print(f"\n{'arm':<18} {'ms/step':>9} {'time vs 1 device':>26} {'dev0 MiB':>9} {'mem vs 1':>9}")
    for name, ts in times.items():
        r, lo, hi = ratio_summary(ts, times[base])
        print(
            f"{name:<18} {statistics.median(ts) * 1e3:>9.2f} "
            f"{f'{r:.3f}x [{lo:.3f}, {hi:.3f}]':>26} {mem[name] / 2**20:>9.3f} "
            f"{mem[name] / mem[base]:>9.3f}"
        )
    compiles = {name: arm[0]._cache_size() for name, arm in arms.items()}
    if any(c != 1 for c in compiles.values()):
        raise SystemExit(f"a step compiled more than once: {compiles}")
    print("\nmemory: parameters + AdamW state bytes on device 0; each step compiled once")


if __name__ == "__main__":
    main()
