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
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import rudax.kernels as rk
from benchmarks._timing import alternate, ratio_summary
from benchmarks.attention import _forward_backward as forward_backward
from benchmarks.attention import _inputs as attention_inputs
from benchmarks.attention import causal_flops
from benchmarks.kernels import (
    adamw_arms,
    block_fields,
    copy_arm,
    nf4_matmul_arms,
    norm_arms,
    pallas_arm_name,
    report,
)
from rudax.kernels import _auto

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "gpu_results.md"


@dataclasses.dataclass(frozen=True)
class Case:
    """One measurement: ``kernels`` (the table's names it gives a row to) at one size.

    ``build(impls, interpret)`` gives the arms and, for a kernel whose speed is its bytes,
    each arm's bytes per call (a copy arm among them); for attention, None (TFLOP/s instead,
    from ``flops``). The Pallas arm runs once per block of ``blocks``, the first None (the
    kernel's own choice), each named ``pallas_arm_name(pallas_arm, block)``.
    """

    kernels: tuple[str, ...]
    size: int
    dtype: str
    group: str  # the benchmark's group title, as the document's table names it
    baseline: str
    pallas_arm: str
    xla_arm: str  # "" where the XLA path is not an arm (attention: against cuDNN)
    build: Callable[[list[str], bool], tuple[dict, dict | None]]
    blocks: tuple[Any, ...] = (None,)
    flops: float = 0.0
    block_kernel: str | None = None  # which of ``kernels`` the blocks are for (None: all)


def _rowwise(op: str, rows: int, width: int, blocks: tuple[Any, ...]) -> Case:
    """rms_norm, layer_norm or silu_mul, forward + backward, on (rows, width) bf16."""

    def build(impls: list[str], interpret: bool) -> tuple[dict, dict]:
        x = jax.random.normal(jax.random.key(0), (rows, width), jnp.float32).astype(jnp.bfloat16)
        second = x if op == "silu_mul" else jnp.ones((width,), jnp.bfloat16)
        bias = jnp.zeros((width,), jnp.bfloat16)
        arms = norm_arms(op, impls, x, second, bias, interpret=interpret, blocks=blocks)
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
        blocks,
    )


def _nf4(tokens: int, features: int, out_features: int, blocks: tuple[Any, ...]) -> Case:
    """nf4_matmul forward + backward (dx), x (tokens, features) bf16, W (out, features)."""

    def build(impls: list[str], interpret: bool) -> tuple[dict, dict]:
        t, k, n = tokens, features, out_features
        arms = nf4_matmul_arms(impls, t, k, n, interpret=interpret, blocks=blocks)
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
        blocks,
    )


def _adamw(n_params: int, blocks: tuple[Any, ...]) -> Case:
    """fused_adamw (its global-norm and update kernels, timed together) at n fp32 params,
    the candidate blocks those of the update kernel (28 of the 32 bytes a parameter moves).
    Each arm holds 12 bytes a parameter (p, m, v; the gradients are shared): at 1B the
    candidates and the skipping twin are left out (the chain, XLA and one Pallas arm, the
    gradients and the copy: 44 GB of an H100's 80, before the steps' temporaries)."""
    big = n_params > 200_000_000
    blocks = blocks[:1] if big else blocks

    def build(impls: list[str], interpret: bool) -> tuple[dict, dict]:
        arms = adamw_arms(impls, n_params, interpret=interpret, blocks=blocks, skip_twin=not big)
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
        blocks,
        block_kernel="adamw_update",
    )


def _attention(b: int, t: int, h: int, head_dim: int, baseline: str, blocks) -> Case:
    """Causal flash attention, forward + backward, bf16, against ``baseline`` ("cudnn" on a
    GPU; "xla", flash_attention's own XLA path, for the CPU check)."""

    def build(impls: list[str], interpret: bool) -> tuple[dict, None]:
        q, k, v, d_out = attention_inputs(b, t, h, h, head_dim, jnp.bfloat16)

        def arm(**kw):
            step = forward_backward(lambda q, k, v: rk.flash_attention(q, k, v, causal=True, **kw))
            return lambda: step(q, k, v, d_out)

        arms = {f"flash_attention {baseline}": arm(impl=baseline)}
        for block in blocks:
            name = pallas_arm_name("flash_attention pallas", block)
            arms[name] = arm(impl="pallas", interpret=interpret, block=block)
        return arms, None

    return Case(
        ("flash_attention",),
        head_dim,
        "bfloat16",
        f"flash_attention causal fwd+bwd B={b} H={h} T={t} K={head_dim} bf16",
        f"flash_attention {baseline}",
        "flash_attention pallas",
        "flash_attention xla" if baseline == "xla" else "",
        build,
        blocks,
        3.5 * causal_flops(b, t, h, head_dim),
    )


# The candidates each sweep tries besides the kernel's own choice (None): about the usual
# Triton shapes for a memory-bound row or elementwise pass, and for flash attention on
# Hopper (FlashAttention-2's 128-row query tiles, more warps and stages), within what fits
# a block's registers and shared memory there. A candidate that fails to compile is dropped.
ROW_BLOCKS = (
    None,
    rk.RowBlock(rows=1, num_warps=4),
    rk.RowBlock(rows=1, num_warps=16),
    rk.RowBlock(rows=2, num_warps=8),
    rk.RowBlock(rows=4, num_warps=8),
)
SILU_BLOCKS = (
    None,
    rk.SiluMulBlock(size=2048, num_warps=4),
    rk.SiluMulBlock(size=4096, num_warps=8),
    rk.SiluMulBlock(size=8192, num_warps=8),
)
# An elementwise pass over 4-5 arrays: more elements per program (fewer programs, more bytes
# in flight per thread) is the usual way to the copy's bandwidth.
ADAMW_BLOCKS = (
    None,
    rk.AdamWBlock(size=2048, num_warps=4),
    rk.AdamWBlock(size=4096, num_warps=8),
    rk.AdamWBlock(size=8192, num_warps=8),
)
NF4_BLOCKS = (
    None,
    rk.NF4MatmulBlock(block_m=64, block_n=128, num_warps=4, num_stages=3),
    rk.NF4MatmulBlock(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
)
ATTENTION_BLOCKS = (
    None,
    rk.FlashAttentionBlock(q=128, num_stages=3),
    rk.FlashAttentionBlock(q=128, num_warps=8, num_stages=3),
    rk.FlashAttentionBlock(q=128, kv=128, kv_backward=128, num_warps=8),
    rk.FlashAttentionBlock(q=128, q_backward=128, num_warps=8, num_stages=3),
)


def cases(small: bool = False) -> list[Case]:
    """The sweep in the order it runs: Llama-8B's sizes first, AdamW at 1B last."""
    if small:
        two = (None, rk.SiluMulBlock(size=2048))
        return [
            _rowwise("rms_norm", 64, 256, ROW_BLOCKS[:2]),
            _rowwise("silu_mul", 64, 256, two),
            _nf4(16, 128, 256, NF4_BLOCKS[:2]),
            _adamw(20_000, ADAMW_BLOCKS[:2]),
            _rowwise("layer_norm", 64, 128, ROW_BLOCKS[:1]),
            _attention(1, 64, 2, 64, "xla", (None, rk.FlashAttentionBlock(q=32))),
        ]
    rows = 8192
    attention = lambda head_dim: _attention(2, 4096, 32, head_dim, "cudnn", ATTENTION_BLOCKS)
    return [
        _rowwise("rms_norm", rows, 4096, ROW_BLOCKS),
        _rowwise("layer_norm", rows, 4096, ROW_BLOCKS),
        _rowwise("silu_mul", rows, 14336, SILU_BLOCKS),
        attention(128),
        _nf4(4096, 4096, 14336, NF4_BLOCKS),
        _nf4(4096, 14336, 4096, NF4_BLOCKS),
        _adamw(125_000_000, ADAMW_BLOCKS),
        attention(64),
        _rowwise("rms_norm", rows, 1024, ROW_BLOCKS),
        _rowwise("layer_norm", rows, 1024, ROW_BLOCKS),
        _rowwise("silu_mul", rows, 4096, SILU_BLOCKS),
        _rowwise("rms_norm", rows, 8192, ROW_BLOCKS),
        _rowwise("layer_norm", rows, 8192, ROW_BLOCKS),
        _adamw(1_000_000_000, ADAMW_BLOCKS),
    ]


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _compiled(arms: dict) -> tuple[dict, dict[str, str]]:
    """The arms that compile and run once, and each failure's first line by arm: a
    candidate block that does not fit this GPU is dropped, not the sweep."""
    ok, failed = {}, {}
    for name, arm in arms.items():
        try:
            jax.block_until_ready(arm())
        except Exception as e:  # any compile or launch error drops the arm, not the sweep
            failed[name] = _first_line(e)
        else:
            ok[name] = arm
    return ok, failed


def _block_fields(block: Any) -> dict[str, int] | None:
    """A row's ``block``: the fields that differ from the defaults ({} for the defaults
    given explicitly); None for the kernel's own choice."""
    return None if block is None else block_fields(block)


def _attention_rows(case: Case, times: dict) -> list[dict]:
    rows = []
    print(f"\n{case.group}")
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        speed = list(ratio_summary(times[case.baseline], ts))
        rows.append(dict(group=case.group, arm=name, ms=ms, tflops=case.flops / ms / 1e9,
                         speed_vs_baseline=speed))  # fmt: skip
        print(f"{name:<60} {ms:9.3f} ms {rows[-1]['tflops']:6.1f} TFLOP/s {speed[0]:.3f}x")
    return rows


def measure(case: Case, *, interpret: bool, rounds: int, iters: int) -> tuple[list, list, dict]:
    """One case: (its rows for the table, its rows for the document, arms that failed; a
    case whose inputs cannot be built, out of memory say, is one failure by its group)."""
    try:
        arms, sizes = case.build(["xla", "pallas"], interpret)
    except Exception as e:  # the next case may still fit
        return [], [], {case.group: _first_line(e)}
    arms, failed = _compiled(arms)
    if case.baseline not in arms:
        return [], [], failed
    times = alternate(arms, rounds=rounds, iters=iters)
    doc_rows: list = []
    if sizes is None:
        doc_rows = _attention_rows(case, times)
    else:
        report(case.group, times, {n: sizes[n] for n in times}, case.baseline, doc_rows)
    speed = {r["arm"]: r["speed_vs_baseline"][0] for r in doc_rows if r["speed_vs_baseline"]}
    candidates = {pallas_arm_name(case.pallas_arm, b): b for b in case.blocks}
    measured = [name for name in candidates if name in speed]
    if not measured or (case.xla_arm and case.xla_arm not in speed):
        return [], doc_rows, failed
    best = max(measured, key=lambda name: speed[name])
    table_rows = [
        dict(
            kernel=kernel,
            size=case.size,
            dtype=case.dtype,
            group=case.group,
            pallas_arm=best,
            xla_arm=case.xla_arm,
            pallas=round(speed[best], 3),
            xla=round(speed[case.xla_arm], 3) if case.xla_arm else None,
            block=_block_fields(candidates[best]) if case.block_kernel in (None, kernel) else None,
        )
        for kernel in case.kernels
    ]
    return table_rows, doc_rows, failed


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
        failed={},
        left_out=[],
    )
    start = time.monotonic()
    todo = cases(small)
    for i, case in enumerate(todo):
        if time.monotonic() - start > budget_s:
            result["left_out"] = [c.group for c in todo[i:]]
            break
        table_rows, doc_rows, failed = measure(
            case, interpret=interpret, rounds=rounds, iters=iters
        )
        result["gpu"]["kernels"] += table_rows
        result["groups"] += doc_rows
        result["failed"] |= failed
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
    ]
    lines += table_lines(result["groups"])
    if result["failed"]:
        lines += ["", "Arms that did not compile or run (dropped):", ""]
        lines += [f"- {arm}: {error}" for arm, error in result["failed"].items()]
    if result["left_out"]:
        lines += ["", f"Left out (the budget ran out): {'; '.join(result['left_out'])}."]
    return "\n".join(lines) + "\n"


def table_lines(rows: list[dict]) -> list[str]:
    """The kernels' rows (GB/s against a copy), then attention's (TFLOP/s), as tables."""
    speed = lambda s: "" if s is None else f"{s[0]:.3f}x [{s[1]:.3f}, {s[2]:.3f}]"
    kernels = [r for r in rows if "gbps" in r]
    attention = [r for r in rows if "tflops" in r]
    lines = []
    if kernels:
        lines += ["| group | arm | ms | GB/s | / copy | speed vs baseline [min, max] |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [
            f"| {r['group']} | {r['arm']} | {r['ms']:.3f} | {r['gbps']:.1f} | "
            f"{r['copy_fraction']:.2f} | {speed(r['speed_vs_baseline'])} |"
            for r in kernels
        ]
    if attention:
        lines += ["", "| group | arm | ms | TFLOP/s | | speed vs baseline [min, max] |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [
            f"| {r['group']} | {r['arm']} | {r['ms']:.3f} | {r['tflops']:.1f} | | "
            f"{speed(r['speed_vs_baseline'])} |"
            for r in attention
        ]
    return lines


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
