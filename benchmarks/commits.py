"""The cost of a change: the same workloads from two source trees, alternated round by round.

A check added for trust (a tree and shape check, masters that adopt replaced weights, a file
lock and a validated step listing) must not cost the step it guards. This runs a fixed set of
workloads from a base commit and from the working tree, each round in a fresh child process
per tree (``python -m benchmarks.commits --child``, the tree first on ``PYTHONPATH``), in
alternating order, and reports each workload's per-round time ratio head/base with its spread:

    python -m benchmarks.commits --base 68db068          # base commit against the work tree
    python -m benchmarks.commits --base v0.1 --rounds 8 --params 8000000

The workloads use only API that both trees have:

* ``adamw fp32``: ``rudax.optim.adamw`` on fp32 parameters (the tree and shape checks; none
  of them should reach the compiled step);
* ``fp32_master(adamw) bf16``: master weights on bf16 parameters (the adoption of replaced
  parameters: one rounding, compare and select per element);
* ``fused_adamw bf16``: the fused step, XLA path, on bf16 parameters;
* ``checkpoint save+restore``: a sync ``Checkpointer`` save and restore of the fp32 adamw
  state, the directory opened anew each time (the lock, the cleanup, the step listing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("adamw fp32", "fp32_master(adamw) bf16", "fused_adamw bf16", "checkpoint save+restore")


def _child(params: int, iters: int) -> dict[str, float | str]:
    """Seconds per call of each workload, timed in this process, and where rudax came from."""
    import jax
    import jax.numpy as jnp
    import optax

    import rudax.checkpoint as rc
    import rudax.optim as ro

    def leaves(dtype):
        rows = max(1, params // (4 * 1024))
        shapes = {"wq": (rows, 1024), "w_up": (rows, 2048), "w_down": (rows, 1024), "b": (1024,)}
        keys = jax.random.split(jax.random.key(0), len(shapes))
        return {
            n: jax.random.normal(k, s, jnp.float32).astype(dtype)
            for k, (n, s) in zip(keys, shapes.items(), strict=True)
        }

    def step_arm(tx, dtype):
        p = leaves(dtype)
        g = jax.tree.map(lambda x: 1e-3 * jnp.ones_like(x), p)
        holder = [p, tx.init(p)]

        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        step = jax.jit(step, donate_argnums=(0, 1))

        def run():
            holder[0], holder[1] = step(holder[0], holder[1], g)
            return holder[0]

        return run

    root = Path(tempfile.mkdtemp(prefix="rudax-commits-"))

    def checkpoint_arm():
        p = leaves(jnp.float32)
        record = rc.TrainingRecord.capture(model=p, optimizer=ro.adamw(1e-3).init(p))
        counter = [0]

        def run():
            counter[0] += 1
            ckpt = rc.Checkpointer(root, keep=2)
            ckpt.save(counter[0], record)
            out = ckpt.restore(record)
            ckpt.close()
            return out.model

        return run

    arms = {
        "adamw fp32": step_arm(ro.adamw(1e-3), jnp.float32),
        "fp32_master(adamw) bf16": step_arm(ro.fp32_master(ro.adamw(1e-3)), jnp.bfloat16),
        "fused_adamw bf16": step_arm(ro.fused_adamw(1e-3, impl="xla"), jnp.bfloat16),
        "checkpoint save+restore": checkpoint_arm(),
    }
    out: dict[str, float | str] = {"rudax": str(Path(rc.__file__).resolve())}
    for name, run in arms.items():
        jax.block_until_ready(run())  # compile, and a first save that creates the directory
        n = 2 if name.startswith("checkpoint") else iters
        start = time.perf_counter()
        result = None
        for _ in range(n):
            result = run()
        jax.block_until_ready(result)
        out[name] = (time.perf_counter() - start) / n
    shutil.rmtree(root)
    return out


def _export(rev: str) -> Path:
    """The tree of commit ``rev`` in a fresh temporary directory (``git archive``)."""
    dest = Path(tempfile.mkdtemp(prefix="rudax-base-"))
    archive = dest / "tree.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", rev], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    return dest


def _run_child(tree: Path, params: int, iters: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    # rudax from `tree` (first on the path, ahead of an editable install's finder); this
    # file by its path, since the base tree may not have it.
    code = (
        "import sys, json, importlib.util as u;"
        "spec = u.spec_from_file_location('_rudax_commits', sys.argv[1]);"
        "m = u.module_from_spec(spec); spec.loader.exec_module(m);"
        "print(json.dumps(m._child(int(sys.argv[2]), int(sys.argv[3]))))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, __file__, str(params), str(iters)],
        env=env,
        cwd=tempfile.gettempdir(),  # never the repository root: its rudax/ would win
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child for {tree} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    where = Path(out.pop("rudax"))
    if not where.is_relative_to(tree.resolve()):
        raise RuntimeError(f"the child for {tree} imported rudax from {where}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the base commit (any git revision)")
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds")
    parser.add_argument("--params", type=int, default=4_000_000, help="parameters per step arm")
    parser.add_argument("--iters", type=int, default=10, help="steps per arm per round")
    args = parser.parse_args()
    if args.rounds < 1 or args.params < 4096 or args.iters < 1:
        parser.error("--rounds and --iters must be >= 1 and --params >= 4096")

    base = _export(args.base)
    trees = {"base": base, "head": ROOT}
    times: dict[str, dict[str, list[float]]] = {t: {w: [] for w in WORKLOADS} for t in trees}
    try:
        for r in range(args.rounds):
            for t in ("base", "head") if r % 2 == 0 else ("head", "base"):
                for w, s in _run_child(trees[t], args.params, args.iters).items():
                    times[t][w].append(s)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        shutil.rmtree(base)

    head_rev = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    print(
        f"\nbase {args.base} against head {head_rev}: {args.params:,} parameters, "
        f"{args.rounds} alternating rounds, a fresh process per tree per round"
    )
    print(f"{'workload':<26} {'base ms':>9} {'head ms':>9}   head/base: median [min, max]")
    for w in WORKLOADS:
        b, h = times["base"][w], times["head"][w]
        ratios = [x / y for x, y in zip(h, b, strict=True)]
        print(
            f"{w:<26} {statistics.median(b) * 1e3:>9.1f} {statistics.median(h) * 1e3:>9.1f}"
            f"   {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
        )


if __name__ == "__main__":
    main()
