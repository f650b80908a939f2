"""AdamW step time: rudax.optim.adamw against optax.adamw, and the machine's copy bandwidth.

Each arm is one jitted step, params and optimizer state donated, on the same fp32 parameters
(16M by default, in a few leaves of transformer-like shapes). AdamW has to read params,
grads, m and v and write params, m and v: 28 bytes per fp32 parameter. The copy arm reads
and writes one fp32 buffer of the same element count in place (8 bytes per element), which
bounds what any elementwise update can reach on this machine.

    python -m benchmarks.optim_step            # 16M parameters
    python -m benchmarks.optim_step --params 1000000 --rounds 5
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import rudax.optim as ro
from benchmarks._timing import alternate, ratio_summary

ADAMW_BYTES_PER_PARAM = 7 * 4  # read p, g, m, v; write p, m, v; fp32
COPY_BYTES_PER_ELEM = 2 * 4  # read and write one fp32 element


def make_params(total: int) -> dict[str, jax.Array]:
    """A few leaves summing to `total` elements: two matrices, a vector and the remainder."""
    d = 1024
    rows = max(1, total // (4 * d))
    sizes = {"wq": (rows, d), "w_up": (rows, 2 * d), "w_down": (rows, d)}
    used = sum(r * c for r, c in sizes.values())
    sizes["rest"] = (max(1, total - used),)
    keys = jax.random.split(jax.random.key(0), len(sizes))
    return {
        name: jax.random.normal(k, shape, jnp.float32)
        for k, (name, shape) in zip(keys, sizes.items(), strict=True)
    }


def make_step(tx: optax.GradientTransformation):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1))


def make_arm(tx, params, grads):
    holder = {"p": jax.tree.map(jnp.copy, params)}
    holder["s"] = tx.init(holder["p"])
    step = make_step(tx)

    def run():
        holder["p"], holder["s"] = step(holder["p"], holder["s"], grads)
        return holder["p"]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=16 * 2**20, help="fp32 parameter count")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds")
    parser.add_argument("--iters", type=int, default=10, help="steps per arm per round")
    args = parser.parse_args()

    params = make_params(args.params)
    n = sum(x.size for x in jax.tree.leaves(params))
    grads = jax.tree.map(lambda p: 1e-3 * jnp.ones_like(p), params)
    hyper = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-2)

    copy_buf = {"x": jnp.zeros((n,), jnp.float32)}
    copy = jax.jit(lambda x: x + 1.0, donate_argnums=0)

    def copy_arm():
        copy_buf["x"] = copy(copy_buf["x"])
        return copy_buf["x"]

    arms = {
        "rudax.optim.adamw": make_arm(ro.adamw(1e-3, **hyper), params, grads),
        "optax.adamw": make_arm(optax.adamw(1e-3, **hyper), params, grads),
        "copy (x + 1, in place)": copy_arm,
    }
    times = alternate(arms, rounds=args.rounds, iters=args.iters)

    def med(xs):
        return sorted(xs)[len(xs) // 2]

    print(
        f"\n{n:,} fp32 parameters, {args.rounds} alternating rounds x {args.iters} steps, "
        f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} devices)"
    )
    print(f"{'arm':<24} {'ms/step':>9} {'GB/s':>7}")
    for name, ts in times.items():
        per = COPY_BYTES_PER_ELEM if name.startswith("copy") else ADAMW_BYTES_PER_PARAM
        print(f"{name:<24} {med(ts) * 1e3:>9.2f} {per * n / med(ts) / 1e9:>7.1f}")
    r, lo, hi = ratio_summary(times["optax.adamw"], times["rudax.optim.adamw"])
    print(
        f"\nspeed rudax / optax (per-round time ratio optax/rudax): "
        f"median {r:.3f}x, range [{lo:.3f}, {hi:.3f}]"
    )
    cb = [COPY_BYTES_PER_ELEM * n / t for t in times["copy (x + 1, in place)"]]
    for name in ("rudax.optim.adamw", "optax.adamw"):
        bw = [ADAMW_BYTES_PER_PARAM * n / t for t in times[name]]
        r, lo, hi = ratio_summary(bw, cb)
        print(f"{name} GB/s as a fraction of copy GB/s: median {r:.2f}, range [{lo:.2f}, {hi:.2f}]")


if __name__ == "__main__":
    main()
