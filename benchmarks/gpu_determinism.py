"""Is a training run bit-identical to itself? Two fresh processes, with and without the flag.

    python -m benchmarks.gpu_determinism --preset mid --steps 5 --json out.json

Each arm (default, ``--deterministic``) runs ``benchmarks.gpu_trainer`` twice, each time in a
fresh process: the same model, batch and optimizer from the same seed. The arm is bitwise
reproducible when both processes' losses are equal bit for bit at every update. The cost of
the flag is the ratio of the arms' median step times. On a CPU both arms are reproducible
(XLA:CPU scatters in order); on a GPU the default arm's embedding scatter-add uses atomics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def run_trainer(preset: str, steps: int, deterministic: bool, peak_size: int) -> dict[str, Any]:
    """One fresh process of ``benchmarks.gpu_trainer``; its JSON results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "benchmarks.gpu_trainer", "--preset", preset]
        cmd += ["--steps", str(steps), "--peak-size", str(peak_size), "--json", str(out)]
        if deterministic:
            cmd.append("--deterministic")
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def compare(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per arm: bitwise reproducible or not, the first update that differs, the step time."""
    arms = {}
    for arm, (a, b) in runs.items():
        la, lb = a["losses_hex"], b["losses_hex"]
        differs = [i + 1 for i, (x, y) in enumerate(zip(la, lb, strict=True)) if x != y]
        arms[arm] = {
            "bitwise": not differs,
            "first_differing_update": differs[0] if differs else None,
            "updates": len(la),
            "step_ms": statistics.median([a["step_ms"], b["step_ms"]]),
            "losses_hex": [la, lb],
        }
    cost = arms["deterministic"]["step_ms"] / arms["default"]["step_ms"]
    return {"arms": arms, "deterministic_step_time_ratio": cost}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--preset", default="mid")
    p.add_argument("--steps", type=int, default=3, help="timed updates per process (+2 warm-up)")
    p.add_argument("--peak-size", type=int, default=2048)
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)
    runs = {
        arm: [run_trainer(args.preset, args.steps, arm == "deterministic", args.peak_size)
              for _ in range(2)]
        for arm in ("default", "deterministic")
    }  # fmt: skip
    results = {"preset": args.preset, "backend": runs["default"][0]["backend"], **compare(runs)}
    for arm, r in results["arms"].items():
        verdict = (
            "bitwise" if r["bitwise"] else f"differs from update {r['first_differing_update']}"
        )
        print(f"{arm:<14} {verdict:<28} {r['step_ms']:.2f} ms/update")
    print(f"--deterministic costs {results['deterministic_step_time_ratio']:.3f}x step time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
