"""The embedding's backward three ways: autodiff's scatter-add, a sorted segment sum, one-hot.

    python -m benchmarks.embedding_backward                    # V=32768, D=768, 16384 ids
    python -m benchmarks.embedding_backward --deterministic --json out.json

Arms, alternated round by round (``benchmarks._timing.alternate``), each the gradient of
``sum(lookup(table, ids) * g)`` with respect to an fp32 table:

* ``scatter``: ``rudax.layers.lookup(..., backward="scatter")``, autodiff's scatter-add (with
  atomics on a GPU; under ``--deterministic`` XLA's deterministic scatter, a serial loop);
* ``sorted``: ``backward="sorted"``, a stable sort, a segmented scan and a gather;
* ``one-hot``: ``one_hot(ids, V).T @ g`` in fp32, the dense alternative for small vocabularies
  (``V x N`` of one-hot, so it is measured only while that is at most ``--one-hot-limit``).

``--deterministic`` sets XLA's deterministic GPU flags first (``enable_deterministic_gpu``),
which is what ``--deterministic`` in the trainer runs under.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from typing import Any, Literal


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--features", type=int, default=768)
    p.add_argument("--ids", type=int, default=16384, help="token positions per step")
    p.add_argument("--one-hot-limit", type=int, default=2**30, help="most V x N elements")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.deterministic:
        import rudax.kernels as rk

        rk.enable_deterministic_gpu()
    import jax
    import jax.numpy as jnp

    import rudax.layers as rl
    from benchmarks._timing import alternate, ratio_summary

    kt, ki, kg = jax.random.split(jax.random.key(0), 3)
    table = jax.random.normal(kt, (args.vocab, args.features), jnp.float32)
    ids = _zipf_ids(ki, args.ids, args.vocab)
    g = jax.random.normal(kg, (args.ids, args.features), jnp.float32)

    def arm(backward: Literal["scatter", "sorted"]):
        def grad(table, ids, g):
            return jax.grad(lambda t: jnp.sum(rl.lookup(t, ids, backward=backward) * g))(table)

        step = jax.jit(grad)
        return lambda: step(table, ids, g)

    def one_hot(table, ids, g):
        return jax.nn.one_hot(ids, table.shape[0], dtype=jnp.float32).T @ g

    arms = {"scatter": arm("scatter"), "sorted": arm("sorted")}
    if args.vocab * args.ids <= args.one_hot_limit:
        step = jax.jit(one_hot)
        arms["one-hot"] = lambda: step(table, ids, g)
    times = alternate(arms, rounds=args.rounds, iters=args.iters)
    rows = []
    print(f"embedding backward, V={args.vocab}, D={args.features}, {args.ids} ids, "
          f"{jax.devices()[0]}, deterministic flags: {args.deterministic}")  # fmt: skip
    for name, ts in times.items():
        r, lo, hi = ratio_summary(times["scatter"], ts)
        rows.append(
            {"arm": name, "ms": statistics.median(ts) * 1e3, "speed_vs_scatter": [r, lo, hi]}
        )
        print(f"{name:<8} {rows[-1]['ms']:9.3f} ms   {r:.3f}x [{lo:.3f}, {hi:.3f}] vs scatter")
    results = {
        "device": str(jax.devices()[0]),
        "deterministic": args.deterministic,
        "vocab": args.vocab,
        "features": args.features,
        "ids": args.ids,
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def _zipf_ids(key: Any, n: int, vocab: int) -> Any:
    """Heavy-tailed ids, as text has: a few rows named often (where atomics contend).

    ``floor(u ** -5)`` for uniform ``u`` is a Pareto tail: rank 1 about half the time.
    """
    import jax
    import jax.numpy as jnp

    u = jax.random.uniform(key, (n,), minval=1e-6, maxval=1.0)
    return jnp.minimum(jnp.floor(u**-5.0) - 1, vocab - 1).astype(jnp.int32)


if __name__ == "__main__":
    main(sys.argv[1:])
