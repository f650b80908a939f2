"""The sweep that writes ``impl="auto"``'s table: each kernel's Pallas and XLA arms at the
sizes that matter, on this GPU, then merged into ``rudax/kernels/auto_table.json``.

    python -m benchmarks.tune_gpu --out tune.json           # on the GPU (gpu_check's "tune")
    python -m benchmarks.tune_gpu --merge tune.json         # here: into the table and the doc

Each case is one kernel at one size (``rudax.kernels._auto``: the feature width, or the
parameter count) and dtype, timed as ``benchmarks.kernels`` times it: forward + backward, the
arms alternated round by round with the op's baseline (its ``*_reference`` under autodiff;
the unfused optax chain for AdamW; the XLA path for NF4) and a device copy. A case's row
keeps each arm's median speed against the baseline; ``auto`` takes Pallas where that is the
faster of the two. The sizes are Llama-8B's first (hidden 4096, MLP 14336), then a smaller
and a larger one, then AdamW at 1B parameters: what runs out of ``--budget-s`` is left out
of the file (a case is never cut in half), and the file is rewritten after every case, so a
run killed from outside still leaves what it finished.

``--merge`` replaces this GPU's entry in the table (or adds it) with the sweep's rows, the
commit measured (``--commit``, else the repository's HEAD) and the date, and appends the
sweep's full table (every arm, ms, GB/s, share of the copy's bandwidth) to
``docs/gpu_results.md`` under the GPU's name: ``tests/kernels/test_auto.py`` checks every
row of the table against that document.

``--small --interpret`` runs the same sweep at toy sizes with the Pallas arms in interpret
mode: a check of the script on a CPU (its timings measure Python, and such a file is
refused by ``--merge`` into the committed table).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks._timing import alternate
from benchmarks.kernels import adamw_arms, copy_arm, nf4_matmul_arms, norm_arms, report
from rudax.kernels import _auto

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "gpu_results.md"


@dataclasses.dataclass(frozen=True)
class Case:
    """One measurement: ``kernels`` (the table's names it gives a row to) at one size."""

    kernels: tuple[str, ...]
    size: int
    dtype: str
    group: str  # the benchmark's group title, as the document's table names it
    baseline: str
    pallas_arm: str
    xla_arm: str
    build: Callable[[list[str], bool], tuple[dict, dict]]  # (impls, interpret) -> arms, bytes


def _rowwise(op: str, rows: int, width: int) -> Case:
    """rms_norm, layer_norm or silu_mul, forward + backward, on (rows, width) bf16."""

    def build(impls: list[str], interpret: bool) -> tuple[dict, dict]:
        x = jax.random.normal(jax.random.key(0), (rows, width), jnp.float32).astype(jnp.bfloat16)
        second = x if op == "silu_mul" else jnp.ones((width,), jnp.bfloat16)
        bias = jnp.zeros((width,), jnp.bfloat16)
        arms = norm_arms(op, impls, x, second, bias, interpret=interpret)
        n = rows * width
        # Least traffic in bf16 elements: a norm reads x, writes y, then reads x and dy and
        # writes dx (5); silu_mul 2 in + 1 out, then 3 in + 2 out (8).
        per_arm = (8 if op == "silu_mul" else 5) * 2 * n
        arms["copy (x + 1, in place)"] = copy_arm(n, jnp.bfloat16)
        sizes = {name: per_arm for name in arms} | {"copy (x + 1, in place)": 2 * 2 * n}
        return arms, sizes

    return Case(
        (op,),
        width,
        "bfloat16",
        f"{op} fwd+bwd ({rows}, {width}) bf16",
        f"{op} autodiff",
        f"{op} pallas",
        f"{op} xla",
        build,
    )


def _nf4(tokens: int, features: int, out_features: int) -> Case:
    """nf4_matmul forward + backward (dx), x (tokens, features) bf16, W (out, features)."""

    def build(impls: list[str], interpret: bool) -> tuple[dict, dict]:
        t, k, n = tokens, features, out_features
        arms = nf4_matmul_arms(impls, t, k, n, interpret=interpret)
        # The forward reads x and W, writes y; the backward reads dy and W, writes dx. W is
        # 2 bytes a weight dense, 0.5 + 1/64 in NF4 (codes and 8-bit absmax codes).
        activations = 2 * (t * k + t * n + t * n + t * k)
        sizes = {name: activations + 2 * (n * k // 2 + n * k // 64) for name in arms}
        sizes["dense bf16 x @ W^T"] = activations + 2 * 2 * n * k
        arms["copy (x + 1, in place)"] = copy_arm(t * k, jnp.bfloat16)
        sizes["copy (x + 1, in place)"] = 2 * 2 * t * k
        return arms, sizes

    flops = 2 * 2 * tokens * features * out_features
    group = (
        f"nf4_matmul fwd+bwd(dx), x ({tokens}, {features}) bf16, W ({out_features}, "
        f"{features}): {flops / 1e9:.0f} GFLOP"
    )
    return Case(
        ("nf4_matmul",),
        features,
        "bfloat16",
        group,
        "nf4_matmul xla",
        "nf4_matmul pallas",
        "nf4_matmul xla",
        build,
    )


def _adamw(n_params: int) -> Case:
    """fused_adamw (its global-norm and update kernels, timed together) at n fp32 params."""

    def build(impls: list[str], interpret: bool) -> tuple[dict, dict]:
        arms = adamw_arms(impls, n_params, interpret=interpret)
        arms["copy (x + 1, in place)"] = copy_arm(n_params, jnp.float32)
        # reads p, g, m, v and writes p, m, v; the norm reads g once more
        sizes = {name: 32 * n_params for name in arms}
        sizes["copy (x + 1, in place)"] = 8 * n_params
        return arms, sizes

    return Case(
        ("adamw_update", "global_norm"),
        n_params,
        "float32",
        f"AdamW step, {n_params:,} fp32 params, clip 1.0",
        "adamw unfused chain",
        "fused_adamw pallas",
        "fused_adamw xla",
        build,
    )


def cases(small: bool = False) -> list[Case]:
    """The sweep in the order it runs: Llama-8B's sizes first, AdamW at 1B last."""
    if small:
        return [
            _rowwise("rms_norm", 64, 256),
            _rowwise("silu_mul", 64, 256),
            _nf4(16, 128, 256),
            _adamw(20_000),
            _rowwise("layer_norm", 64, 128),
        ]
    rows = 8192
    return [
        _rowwise("rms_norm", rows, 4096),
        _rowwise("layer_norm", rows, 4096),
        _rowwise("silu_mul", rows, 14336),
        _nf4(4096, 4096, 14336),
        _nf4(4096, 14336, 4096),
        _adamw(125_000_000),
        _rowwise("rms_norm", rows, 1024),
        _rowwise("layer_norm", rows, 1024),
        _rowwise("silu_mul", rows, 4096),
        _rowwise("rms_norm", rows, 8192),
        _rowwise("layer_norm", rows, 8192),
        _adamw(1_000_000_000),
    ]


def measure(case: Case, *, interpret: bool, rounds: int, iters: int) -> tuple[list, list]:
    """One case: (its rows for the table, its rows for the document)."""
    arms, sizes = case.build(["xla", "pallas"], interpret)
    times = alternate(arms, rounds=rounds, iters=iters)
    doc_rows: list = []
    report(case.group, times, sizes, case.baseline, doc_rows)
    speed = {r["arm"]: r["speed_vs_baseline"][0] for r in doc_rows if r["speed_vs_baseline"]}
    table_rows = [
        dict(
            kernel=kernel,
            size=case.size,
            dtype=case.dtype,
            group=case.group,
            pallas_arm=case.pallas_arm,
            xla_arm=case.xla_arm,
            pallas=round(speed[case.pallas_arm], 3),
            xla=round(speed[case.xla_arm], 3),
        )
        for kernel in case.kernels
    ]
    return table_rows, doc_rows


def sweep(
    out: Path,
    *,
    small: bool,
    interpret: bool,
    budget_s: float,
    rounds: int,
    iters: int,
    command: str,
) -> dict[str, Any]:
    """Runs the cases while the budget lasts, rewriting ``out`` after each; the result."""
    device = jax.devices()[0]
    if device.platform != "gpu" and not interpret:
        raise SystemExit(
            f"benchmarks.tune_gpu measures a GPU; this host's device is {device}: pass "
            "--small --interpret to check the script here"
        )
    result: dict[str, Any] = dict(
        schema=_auto.SCHEMA,
        interpret=interpret,
        jax=jax.__version__,
        date=datetime.date.today().isoformat(),
        gpu=dict(
            name=device.device_kind,
            compute_capability=str(getattr(device, "compute_capability", "")),
            command=command,
            kernels=[],
        ),
        groups=[],
        left_out=[],
    )
    start = time.monotonic()
    todo = cases(small)
    for i, case in enumerate(todo):
        if time.monotonic() - start > budget_s:
            result["left_out"] = [c.group for c in todo[i:]]
            break
        table_rows, doc_rows = measure(case, interpret=interpret, rounds=rounds, iters=iters)
        result["gpu"]["kernels"] += table_rows
        result["groups"] += doc_rows
        out.write_text(json.dumps(result, indent=1) + "\n")
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


# ----------------------------------------------------------------------------- merge
def _head() -> str:
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
    except OSError:
        return "unknown commit"
    return proc.stdout.strip() or "unknown commit"


def doc_section(result: dict[str, Any], measured: str) -> str:
    """The sweep's full table, for ``docs/gpu_results.md``."""
    gpu = result["gpu"]
    lines = [
        f"## Tuned: {gpu['name']}",
        "",
        f"`{gpu['command']}`: {measured}, compute capability {gpu['compute_capability']}. "
        f"The rows of `rudax/kernels/auto_table.json` for this GPU.",
        "",
        "| group | arm | ms | GB/s | / copy | speed vs baseline [min, max] |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["groups"]:
        speed = row["speed_vs_baseline"]
        text = "" if speed is None else f"{speed[0]:.3f}x [{speed[1]:.3f}, {speed[2]:.3f}]"
        lines.append(
            f"| {row['group']} | {row['arm']} | {row['ms']:.3f} | {row['gbps']:.1f} | "
            f"{row['copy_fraction']:.2f} | {text} |"
        )
    if result["left_out"]:
        lines += ["", f"Left out (the budget ran out): {'; '.join(result['left_out'])}."]
    return "\n".join(lines) + "\n"


def merge(
    result_path: Path,
    *,
    table: Path = _auto.TABLE_PATH,
    doc: Path = DOC,
    commit: str | None = None,
) -> str:
    """Puts a sweep's GPU entry into ``table`` (replacing one of the same name) and its
    full table at the end of ``doc``; returns the GPU's name. Nothing is written when the
    sweep is refused."""
    result = json.loads(Path(result_path).read_text())
    if result.get("schema") != _auto.SCHEMA:
        raise SystemExit(f"{result_path}: schema must be {_auto.SCHEMA}")
    if result["interpret"] and Path(table).resolve() == _auto.TABLE_PATH.resolve():
        raise SystemExit(
            f"{result_path} timed Pallas in interpret mode (a CPU check): it does not go "
            f"into the committed table"
        )
    if not result["gpu"]["kernels"]:
        raise SystemExit(f"{result_path}: no case finished, nothing to merge")
    measured = f"{result['date']}, jax {result['jax']}, commit {commit or _head()}"
    entry = dict(result["gpu"], measured=measured)
    data = json.loads(Path(table).read_text())
    gpus = [g for g in data["gpus"] if g["name"] != entry["name"]]
    replaced = len(gpus) != len(data["gpus"])
    # A new GPU goes after the reference (the first), which stays the fallback of last resort.
    data["gpus"] = (
        [*gpus, entry]
        if not replaced
        else [entry if g["name"] == entry["name"] else g for g in data["gpus"]]
    )
    text = json.dumps(data, indent=1) + "\n"
    _auto.load_table_text(text, str(table))  # refuse before writing anything
    Path(table).write_text(text)
    with open(doc, "a") as f:
        f.write("\n" + doc_section(result, measured))
    return entry["name"]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the sweep's result here (JSON)")
    p.add_argument("--merge", type=Path, help="a sweep's result to merge into the table")
    p.add_argument("--table", type=Path, default=_auto.TABLE_PATH, help="for --merge")
    p.add_argument("--doc", type=Path, default=DOC, help="for --merge")
    p.add_argument("--commit", help="for --merge: the commit measured (default: HEAD)")
    p.add_argument("--budget-s", type=float, default=150.0, help="start no case after this")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--small", action="store_true", help="toy sizes (a CPU check)")
    p.add_argument("--interpret", action="store_true", help="Pallas in interpret mode")
    args = p.parse_args(argv)
    if (args.out is None) == (args.merge is None):
        p.error("give --out (measure) or --merge (merge a measurement), one of them")
    if args.merge is not None:
        name = merge(args.merge, table=args.table, doc=args.doc, commit=args.commit)
        print(f"merged {name} into {args.table} and {args.doc}")
        return 0
    command = "python -m benchmarks.tune_gpu " + " ".join(sys.argv[1:] if argv is None else argv)
    result = sweep(
        args.out,
        small=args.small,
        interpret=args.interpret,
        budget_s=args.budget_s,
        rounds=args.rounds,
        iters=args.iters,
        command=command,
    )
    print(f"{len(result['gpu']['kernels'])} rows on {result['gpu']['name']}, left out: "
          f"{result['left_out'] or 'none'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
