"""Remat and scanned layers: XLA's temporary bytes, step time and compile time of the LM step.

    python -m benchmarks.remat                       # policies: the default model and a 4x deeper
    python -m benchmarks.remat --depths 4,16,64      # compile and step time by depth
    python -m benchmarks.remat --rounds 3 --iters 1 --json remat.json

The step is the trainer's gradient step (``rudax.models.next_token_loss_sum``'s value and gradient
under ``jax.jit``) of its default model, a ``rudax.models.LlamaForCausalLM``
(``python -m examples.lm.train``'s flags: width 256, 4 layers, 256 tokens, 16 sequences, a
vocabulary of 8192, bf16 storage, fp32 compute; ``--d-model``, ``--n-layers``,
``--vocab-size``, ``--seq-len`` and ``--batch-size`` change them). Every arm of a model holds
the same weights: one model, converted between the layouts (``ModelSpec.adopt``).

* Policies (the default): for the default model and one ``--deep-factor`` times as deep,
  each layout (``unrolled``: a Python loop of layers; ``scanned``: ``--scan-layers``, the
  layers stored stacked and run as one ``lax.scan``) and each policy of
  ``rudax.layers.REMAT_POLICIES``, the step is compiled once and ``compiled.memory_analysis()``
  read (``temp``: XLA's temporary buffers, where the activations kept for the backward
  live); then all of a model's arms are timed, alternated round by round. Ratios are against
  the same model's unrolled ``"none"`` arm in the same round, median [min, max].
* Depths (``--depths``): for each number of blocks, unrolled against scanned (remat
  ``none``): the seconds to trace, lower and compile (a fresh ``jax.jit`` each time, arms
  alternated over ``--rounds``), and the step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

LAYOUTS = ("unrolled", "scanned")


def _spread(r: Sequence[float]) -> str:
    """A ratio summary (median, min, max) as the tables print it."""
    return f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]"


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import rudax.models as rm
    from benchmarks._trainer import trainer_recipe

    base = trainer_recipe(
        seq_len=args.seq_len,
        hidden_size=args.d_model,
        num_hidden_layers=args.n_layers,
        vocab_size=args.vocab_size,
    ).spec
    batch = jax.random.randint(
        jax.random.key(0), (args.batch_size, args.seq_len + 1), 0, base.config.vocab_size
    )

    def compile_step(spec: Any, model: Any) -> tuple[Any, float]:
        """The gradient step of ``model`` laid out as ``spec`` says (its remat and layers),
        compiled; and the seconds to trace, lower and compile it. ``model`` is converted in
        place (``ModelSpec.adopt``): every arm holds the same weights."""
        graphdef, params, rest = nnx.split(spec.adopt(model), nnx.Param, ...)
        # Variables of the step's own, holding the same arrays: converting the model to the
        # other layout later empties the model's Variables, not these.
        params, rest = jax.tree.map(lambda x: x, (params, rest))

        def value_and_grad(params: Any, rest: Any, batch: Any) -> Any:
            model = lambda p: nnx.merge(graphdef, p, rest)
            loss = lambda p: rm.next_token_loss_sum(model(p), batch, chunk=spec.loss_chunk)
            return jax.value_and_grad(lambda p: loss(p)[0])(params)

        start = time.perf_counter()
        compiled = jax.jit(value_and_grad).lower(params, rest, batch).compile()
        seconds = time.perf_counter() - start
        return (lambda: compiled(params, rest, batch)), compiled, seconds

    c = base.config
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; hidden {c.hidden_size}, "
        f"{args.batch_size} x {args.seq_len} tokens, params {jnp.dtype(c.param_dtype).name}, "
        f"compute {base.dtype.name}; {args.rounds} rounds x {args.iters} steps"
    )
    return {"base": base, "compile": compile_step}


def _with_layers(spec: Any, n: int) -> Any:
    """``spec`` with ``n`` decoder layers."""
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, num_hidden_layers=n))


def policies_table(args: argparse.Namespace, policies: Sequence[str]) -> list[dict[str, Any]]:
    from benchmarks._timing import alternate, ratio_summary

    s = _setup(args)
    base = s["base"]
    n = base.config.num_hidden_layers
    deep = _with_layers(base, n * args.deep_factor)
    models = {f"default ({n} blocks)": base, f"deep ({n * args.deep_factor} blocks)": deep}
    rows = []
    for name, spec in models.items():
        model = spec.create(0)  # the same weights for every arm
        steps, info = {}, {}
        for layout in LAYOUTS:
            for policy in policies:
                arm = dataclasses.replace(spec, remat=policy, scan_layers=layout == "scanned")
                run, compiled, seconds = s["compile"](arm, model)
                analysis = compiled.memory_analysis()
                info[layout, policy] = {
                    "compile_s": seconds,
                    "temp_bytes": int(analysis.temp_size_in_bytes),
                    "argument_bytes": int(analysis.argument_size_in_bytes),
                    "output_bytes": int(analysis.output_size_in_bytes),
                }
                steps[layout, policy] = run
        times = alternate(steps, rounds=args.rounds, iters=args.iters)
        baseline = ("unrolled", "none")
        for key, arm_info in info.items():
            row = {"model": name, "layout": key[0], "policy": key[1], **arm_info}
            row["step_s"] = statistics.median(times[key])
            row["temp_vs_none"] = arm_info["temp_bytes"] / info[baseline]["temp_bytes"]
            row["step_vs_none"] = ratio_summary(times[key], times[baseline])
            rows.append(row)
    print(
        f"\n{'model':<20} {'layout':<9} {'policy':<24} {'temp MB':>8} {'vs none':>8} "
        f"{'step ms':>8} {'step vs none':<22} {'compile s':>9}"
    )
    for r in rows:
        print(
            f"{r['model']:<20} {r['layout']:<9} {r['policy']:<24} {r['temp_bytes'] / 1e6:>8.1f} "
            f"{r['temp_vs_none']:>8.3f} {r['step_s'] * 1e3:>8.1f} {_spread(r['step_vs_none']):<22} "
            f"{r['compile_s']:>9.1f}"
        )
    print(
        "\nratios: against the same model's unrolled 'none' arm (temp bytes; step time per"
        " round, median [min, max])."
    )
    return rows


def depths_table(args: argparse.Namespace, depths: Sequence[int]) -> list[dict[str, Any]]:
    from benchmarks._timing import ratio_summary, time_once

    s = _setup(args)
    rows = []
    for n in depths:
        spec = _with_layers(s["base"], n)
        model = spec.create(0)
        compile_s: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        step_s: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        for r in range(args.rounds):
            for layout in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:
                arm = dataclasses.replace(spec, scan_layers=layout == "scanned")
                run, _, seconds = s["compile"](arm, model)  # a fresh jax.jit each time
                compile_s[layout].append(seconds)
                step_s[layout].append(time_once(run, args.iters))
        row = {"blocks": n}
        for layout in LAYOUTS:
            row[f"{layout}_compile_s"] = statistics.median(compile_s[layout])
            row[f"{layout}_step_s"] = statistics.median(step_s[layout])
        row["compile_scanned_vs_unrolled"] = ratio_summary(
            compile_s["scanned"], compile_s["unrolled"]
        )
        row["step_scanned_vs_unrolled"] = ratio_summary(step_s["scanned"], step_s["unrolled"])
        rows.append(row)
    print(
        f"\n{'blocks':>6} {'compile s unrolled':>18} {'scanned':>8} {'scanned/unrolled':<22} "
        f"{'step ms unrolled':>16} {'scanned':>8} {'scanned/unrolled':<22}"
    )
    for r in rows:
        print(
            f"{r['blocks']:>6} {r['unrolled_compile_s']:>18.1f} {r['scanned_compile_s']:>8.1f} "
            f"{_spread(r['compile_scanned_vs_unrolled']):<22} {r['unrolled_step_s'] * 1e3:>16.1f} "
            f"{r['scanned_step_s'] * 1e3:>8.1f} {_spread(r['step_scanned_vs_unrolled']):<22}"
        )
    print("\nratios: scanned over unrolled per round (time; lower is better), median [min, max].")
    return rows


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--deep-factor", type=int, default=4, help="deep model's blocks / default's")
    p.add_argument("--depths", default=None, help="comma-separated block counts: depth table")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4, help="blocks of the default model")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--policies", default=None, help="comma-separated (default: all)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.depths is not None:
        depths = [int(n) for n in args.depths.split(",")]
        result = {"args": vars(args), "depths": depths_table(args, depths)}
    else:
        import rudax.layers as rl

        given = rl.REMAT_POLICIES if args.policies is None else args.policies.split(",")
        policies = ("none", *(q for q in given if q != "none"))  # "none" is the baseline
        result = {"args": vars(args), "rows": policies_table(args, policies)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
