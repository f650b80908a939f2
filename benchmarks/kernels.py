"""Kernel benchmark: rudax.kernels' paths against XLA and a device copy, in one run.

For each op the arms are alternated round by round with a copy of the op's main tensor on
the same device, so every time is reported next to the bandwidth this device reached in the
same minute:

- rms_norm and layer_norm, forward + backward, on (rows, features) bf16 (default 8192 x 4096);
- silu_mul, forward + backward, on the same shape; each op also as its `*_reference` under
  plain autodiff, the baseline its speed ratios are taken against;
- fused AdamW (`rudax.optim.fused_adamw`, clipping included) at 125M fp32 parameters, against
  the unfused `chain(clip_by_global_norm, adamw)` it equals;
- linear_cross_entropy, forward + backward, against the whole logits under autodiff
  (default 8192 tokens, 2048 features, vocabulary 32768);
- nf4_matmul, forward + backward (dx), x (tokens, in) bf16 times an NF4 weight (out, in)
  (default 4096 tokens, 4096 x 4096), against its XLA path (dequantize, then dot) and a dense
  bf16 weight's matmul (what the NF4 base replaces).

On CPU only the XLA paths run (Pallas runs on CPU only in interpret mode, which measures
Python, not a kernel). On GPU the Pallas paths run against their XLA fallbacks.

    python -m benchmarks.kernels                     # full sizes
    python -m benchmarks.kernels --rows 1024 --features 1024 --adamw-params 4000000 \
        --nf4-tokens 256 --nf4-features 1024 --loss-tokens 512 --loss-features 256 --vocab 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import jax
import jax.numpy as jnp
import optax

import rudax.kernels as rk
import rudax.optim as ro
from benchmarks._timing import alternate, ratio_summary


def copy_arm(n: int, dtype) -> callable:
    """An in-place x + 1 over n elements: reads and writes each once."""
    buf = {"x": jnp.zeros((n,), dtype)}
    step = jax.jit(lambda x: x + jnp.ones((), dtype), donate_argnums=0)

    def run():
        buf["x"] = step(buf["x"])
        return buf["x"]

    return run


def block_fields(block) -> dict:
    """A block's fields that differ from its dataclass's defaults ({} for the defaults)."""
    default = type(block)()
    return {
        f.name: getattr(block, f.name)
        for f in dataclasses.fields(block)
        if getattr(block, f.name) != getattr(default, f.name)
    }


def block_name(block) -> str:
    """``block_fields`` as ``"size=2048,num_warps=8"`` ("" for the defaults): the suffix of a
    Pallas arm run with it."""
    return ",".join(f"{name}={value}" for name, value in block_fields(block).items())


def pallas_arm_name(base: str, block) -> str:
    """``base`` (``"rms_norm pallas"``), with the block's fields when one is given."""
    return base if block is None else f"{base} {block_name(block) or 'defaults'}"


def norm_arms(
    op: str, impls: list[str], x, scale, bias, *, interpret: bool = False, blocks=(None,)
) -> dict:
    """Forward + backward of `op` per impl, and of its `*_reference` under plain autodiff
    (what a user writing the op in jnp would run: the baseline each path is compared to).
    ``interpret``: the Pallas arm in interpret mode (a CPU check of a sweep, not a timing);
    ``blocks``: the Pallas arm once per block (None: the kernel's own choice), named by
    ``pallas_arm_name``."""

    def fwd_bwd(impl, block=None):
        kw = {} if impl == "autodiff" else {"impl": impl, "interpret": interpret}
        if block is not None:
            kw["block"] = block
        ops = {
            "rms_norm": rk.rms_norm_reference if impl == "autodiff" else rk.rms_norm,
            "layer_norm": rk.layer_norm_reference if impl == "autodiff" else rk.layer_norm,
            "silu_mul": rk.silu_mul_reference if impl == "autodiff" else rk.silu_mul,
        }

        def f(x, scale, dy):
            if op == "rms_norm":
                fn = lambda x, s: ops[op](x, s, epsilon=1e-6, **kw)
                y, vjp = jax.vjp(fn, x, scale)
            elif op == "layer_norm":
                fn = lambda x, s, b: ops[op](x, s, b, epsilon=1e-5, **kw)
                y, vjp = jax.vjp(fn, x, scale, bias)
            else:
                y, vjp = jax.vjp(lambda g, u: ops[op](g, u, **kw), x, scale)
            return y, vjp(dy)

        step = jax.jit(f)
        dy = jnp.ones_like(x)
        return lambda: step(x, scale, dy)

    arms = {f"{op} {impl}": fwd_bwd(impl) for impl in ["autodiff", *impls] if impl != "pallas"}
    if "pallas" in impls:
        for block in blocks:
            arms[pallas_arm_name(f"{op} pallas", block)] = fwd_bwd("pallas", block)
    return arms


def adamw_arms(
    impls: list[str],
    n_params: int,
    *,
    interpret: bool = False,
    blocks=(None,),
    skip_twin: bool = True,
) -> dict:
    """One AdamW step (update and apply) at ``n_params`` fp32 parameters per optimizer: the
    unfused chain, its non-finite-skipping twin (unless ``skip_twin`` is False: every arm
    holds its own parameters and moments, 12 bytes a parameter), and ``fused_adamw`` per impl,
    its Pallas arm once per update-kernel block of ``blocks`` (as ``norm_arms``)."""
    d = 4096
    params = {"w": jnp.zeros((n_params // d, d), jnp.float32), "b": jnp.zeros((n_params % d + 1,))}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    chain = optax.chain(ro.clip_by_global_norm(1.0), ro.adamw(1e-3))
    # fused_adamw also skips non-finite steps; skip_nonfinite(chain) is its exact unfused
    # equivalent, the plain chain a lower bound that checks nothing.
    txs = {"adamw unfused chain": chain}
    if skip_twin:
        txs["skip_nonfinite(chain)"] = ro.skip_nonfinite(chain)
    for impl in impls:
        for block in blocks if impl == "pallas" else (None,):
            txs[pallas_arm_name(f"fused_adamw {impl}", block)] = ro.fused_adamw(
                1e-3, max_grad_norm=1.0, impl=impl, interpret=interpret, block=block
            )

    def make(tx):
        holder = {"p": jax.tree.map(jnp.copy, params)}
        holder["s"] = tx.init(holder["p"])

        def step(p, s, g):
            # update then apply_updates, as a training step runs them (rudax's trainer too):
            # fused_adamw's in one pass that writes p, m and v over their donated buffers
            return ro.update_and_apply(tx, g, s, p)

        step = jax.jit(step, donate_argnums=(0, 1))

        def run():
            holder["p"], holder["s"] = step(holder["p"], holder["s"], grads)
            return holder["p"]

        return run

    return {name: make(tx) for name, tx in txs.items()}


def nf4_matmul_arms(
    impls: list[str],
    tokens: int,
    features: int,
    out_features: int,
    *,
    interpret: bool = False,
    blocks=(None,),
) -> dict:
    """Forward + backward (dx only: the NF4 base is frozen) of x @ W^T, W (out, in); the
    Pallas arm once per block of ``blocks`` (as ``norm_arms``).

    The weight is an argument of the jitted step, not a constant folded into it; each arm
    dequantizes (or reads) it on every call, as a fine-tuning step does.
    """
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (tokens, features), jnp.float32).astype(jnp.bfloat16)
    w = (0.02 * jax.random.normal(kw, (out_features, features), jnp.float32)).astype(jnp.bfloat16)
    q = rk.nf4_quantize(w)
    dy = jnp.ones((tokens, out_features), jnp.bfloat16)

    def fwd_bwd(op, weight):
        def f(x, weight, dy):
            y, vjp = jax.vjp(lambda x: op(x, weight), x)
            return y, vjp(dy)

        step = jax.jit(f)
        return lambda: step(x, weight, dy)

    arms = {"dense bf16 x @ W^T": fwd_bwd(lambda x, w: x @ w.T, w)}
    for impl in impls:
        for block in blocks if impl == "pallas" else (None,):
            op = lambda x, q, impl=impl, block=block: rk.nf4_matmul(
                x, q, impl=impl, interpret=interpret, block=block
            )
            arms[pallas_arm_name(f"nf4_matmul {impl}", block)] = fwd_bwd(op, q)
    return arms


def loss_arms(tokens: int, features: int, vocab: int) -> dict:
    """Forward + backward (features and table) of the summed cross entropy over the vocabulary:
    ``linear_cross_entropy`` (chunked, never the whole [N, V] logits) against its reference
    (the whole logits, differentiated by autodiff), both computing in bf16."""
    kx, kw, kl = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(kx, (tokens, features), jnp.float32).astype(jnp.bfloat16)
    table = (0.02 * jax.random.normal(kw, (vocab, features), jnp.float32)).astype(jnp.bfloat16)
    labels = jax.random.randint(kl, (tokens,), 0, vocab)

    def fwd_bwd(loss):
        step = jax.jit(jax.value_and_grad(lambda x, t: loss(x, t, labels)[0], argnums=(0, 1)))
        return lambda: step(x, table)

    return {
        "full logits + autodiff": fwd_bwd(rk.linear_cross_entropy_reference),
        "linear_cross_entropy": fwd_bwd(rk.linear_cross_entropy),
    }


def report(title: str, times: dict, bytes_per_call: dict, baseline: str, rows: list) -> None:
    copy_name = next(n for n in times if n.startswith("copy"))
    print(f"\n{title}")
    print(f"{'arm':<28} {'ms':>9} {'GB/s':>7} {'/copy':>6} {'speed vs ' + baseline:>26}")
    for name, ts in times.items():
        med = statistics.median(ts)
        gbs = bytes_per_call[name] / med / 1e9
        frac, _, _ = ratio_summary(
            [bytes_per_call[name] / t for t in ts],
            [bytes_per_call[copy_name] / t for t in times[copy_name]],
        )
        r, lo, hi = ratio_summary(times[baseline], ts)
        speed = "" if name.startswith("copy") else f"{r:.3f}x [{lo:.3f}, {hi:.3f}]"
        print(f"{name:<28} {med * 1e3:>9.3f} {gbs:>7.1f} {frac:>6.2f} {speed:>26}")
        rows.append(
            dict(
                group=title,
                arm=name,
                ms=med * 1e3,
                gbps=gbs,
                copy_fraction=frac,
                speed_vs_baseline=None if name.startswith("copy") else [r, lo, hi],
            )
        )


def _write(path: str | None, rows: list) -> None:
    """The rows so far: a run cut short still leaves every finished group's figures."""
    if path:
        with open(path, "w") as f:
            json.dump(
                dict(jax=jax.__version__, device=str(jax.devices()[0]), rows=rows), f, indent=1
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--features", type=int, default=4096)
    parser.add_argument("--adamw-params", type=int, default=125_000_000)
    parser.add_argument("--nf4-tokens", type=int, default=4096, help="rows of x for nf4_matmul")
    parser.add_argument("--nf4-features", type=int, default=4096, help="in = out features")
    parser.add_argument("--loss-tokens", type=int, default=8192, help="rows of the loss's input")
    parser.add_argument("--loss-features", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768, help="the loss's vocabulary")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", help="also write the table rows to this file")
    args = parser.parse_args()

    on_gpu = jax.default_backend() == "gpu"
    impls = ["xla", "pallas"] if on_gpu else ["xla"]
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}: {jax.devices()[0]}; "
        f"{args.rounds} alternating rounds x {args.iters} calls per arm"
    )
    rows: list = []

    key = jax.random.key(0)
    shape = (args.rows, args.features)
    n = args.rows * args.features
    x = jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
    scale = jnp.ones((args.features,), jnp.bfloat16)
    bias = jnp.zeros((args.features,), jnp.bfloat16)
    # Minimum traffic in bf16 elements: forward reads x, writes y; backward reads x and dy,
    # writes dx (the affine parameters are negligible). silu_mul: 2 in + 1 out, 3 in + 2 out.
    for op, elems in (("rms_norm", 5), ("layer_norm", 5), ("silu_mul", 8)):
        second = x if op == "silu_mul" else scale
        arms = norm_arms(op, impls, x, second, bias)
        arms["copy (x + 1, in place)"] = copy_arm(n, jnp.bfloat16)
        bytes_per_call = {name: elems * 2 * n for name in arms}
        bytes_per_call["copy (x + 1, in place)"] = 2 * 2 * n
        times = alternate(arms, rounds=args.rounds, iters=args.iters)
        report(f"{op} fwd+bwd {shape} bf16", times, bytes_per_call, f"{op} autodiff", rows)
        _write(args.json, rows)

    arms = adamw_arms(impls, args.adamw_params)
    arms["copy (x + 1, in place)"] = copy_arm(args.adamw_params, jnp.float32)
    # AdamW reads p, g, m, v and writes p, m, v; the norm needs one more read of g.
    bytes_per_call = {name: 32 * args.adamw_params for name in arms}
    bytes_per_call["copy (x + 1, in place)"] = 8 * args.adamw_params
    times = alternate(arms, rounds=args.rounds, iters=max(1, args.iters // 2))
    report(
        f"AdamW step, {args.adamw_params:,} fp32 params, clip 1.0",
        times,
        bytes_per_call,
        "adamw unfused chain",
        rows,
    )
    _write(args.json, rows)

    t, d = args.nf4_tokens, args.nf4_features
    arms = nf4_matmul_arms(impls, t, d, d)
    arms["copy (x + 1, in place)"] = copy_arm(t * d, jnp.bfloat16)
    # Least traffic: the forward reads x and W, writes y; the backward reads dy and W, writes
    # dx. W is 2 bytes a weight dense, 0.5 + 1/64 in NF4 (codes and the 8-bit absmax codes).
    activations = 2 * 2 * (t * d + t * d)
    bytes_per_call = {name: activations + 2 * (d * d // 2 + d * d // 64) for name in arms}
    bytes_per_call["dense bf16 x @ W^T"] = activations + 2 * 2 * d * d
    bytes_per_call["copy (x + 1, in place)"] = 2 * 2 * t * d
    times = alternate(arms, rounds=args.rounds, iters=args.iters)
    report(
        f"nf4_matmul fwd+bwd(dx), x ({t}, {d}) bf16, W ({d}, {d}): {4 * t * d * d / 1e9:.3g} GFLOP",
        times,
        bytes_per_call,
        "nf4_matmul xla",
        rows,
    )
    _write(args.json, rows)

    t, d, v = args.loss_tokens, args.loss_features, args.vocab
    arms = loss_arms(t, d, v)
    arms["copy (x + 1, in place)"] = copy_arm(t * d, jnp.bfloat16)
    # Least traffic: read x and the table twice (forward, backward), write dx and dtable.
    bytes_per_call = {name: 2 * 3 * (t * d + v * d) for name in arms}
    bytes_per_call["copy (x + 1, in place)"] = 2 * 2 * t * d
    times = alternate(arms, rounds=args.rounds, iters=args.iters)
    report(
        f"cross entropy fwd+bwd, x ({t}, {d}) bf16, vocabulary {v}: "
        f"{6 * t * d * v / 1e9:.3g} GFLOP",
        times,
        bytes_per_call,
        "full logits + autodiff",
        rows,
    )
    _write(args.json, rows)


if __name__ == "__main__":
    main()
