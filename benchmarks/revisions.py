"""Paired A/B of a program between two git revisions: is the change slower?

    python -m benchmarks.revisions --base 9ded3f6                     # the trainer, HEAD vs it
    python -m benchmarks.revisions --base v1 --head v2 --rounds 5 -- --steps 60 --moe

Each revision is checked out into a temporary ``git worktree`` (the working tree is not
touched) and ``python -m examples.lm.train`` runs there with the same flags (after ``--``;
by default the main job's model for ``--steps 40``, no evaluation or checkpoint past the
end), its run directory and prepared data under one temporary folder, both revisions reading
the same prepared corpus. The runs alternate, base then head, for ``--rounds`` rounds; each
run's ``tokens_per_s`` is the trainer's own (its ``end`` row in ``metrics.jsonl``: tokens
of the updates after the first, which compiles, over their time). Printed: each run's rate,
and head / base per round with the median and the spread, as every benchmark here reports
a comparison on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_FLAGS = ["--steps", "40", "--eval-every", "1000", "--checkpoint-every", "1000"]


def _worktree(rev: str, root: Path) -> Path:
    path = root / f"tree-{rev.replace('/', '_')}"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev],
        check=True,
        capture_output=True,
    )
    return path


def _run(tree: Path, flags: list[str], out: Path, data: Path) -> float:
    """One trainer run in ``tree``; its tokens/s."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "examples.lm.train", "--run-dir", str(out)]
    cmd += ["--data-dir", str(data), *flags]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree.name}: the trainer failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return float(next(r for r in rows if r["kind"] == "end")["tokens_per_s"])


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1 :] if "--" in argv else DEFAULT_FLAGS
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.revisions", description=__doc__)
    p.add_argument("--base", required=True, help="the revision to compare against")
    p.add_argument("--head", default="HEAD", help="the revision measured (default: HEAD)")
    p.add_argument("--rounds", type=int, default=3, help="base/head pairs (default: 3)")
    args = p.parse_args(own)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        trees = {
            name: _worktree(rev, root) for name, rev in (("base", args.base), ("head", args.head))
        }
        try:
            rates: dict[str, list[float]] = {"base": [], "head": []}
            for r in range(args.rounds):
                for name in ("base", "head"):
                    rate = _run(trees[name], flags, root / f"run-{name}-{r}", root / "data")
                    rates[name].append(rate)
                    print(f"round {r + 1} {name} ({trees[name].name}): {rate:,.0f} tokens/s")
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                    capture_output=True,
                )
    ratios = [h / b for h, b in zip(rates["head"], rates["base"], strict=True)]
    print(
        f"head / base tokens/s: {statistics.median(ratios):.3f} "
        f"[{min(ratios):.3f}, {max(ratios):.3f}] over {args.rounds} rounds; flags: "
        + " ".join(flags)
    )
    return {"rates": rates, "ratios": ratios}


if __name__ == "__main__":
    main()
