"""The whole GPU table in one call: stages with their own time budgets, one summary.

    PYTHONPATH=$PWD python -m benchmarks.gpu_check --out $OUT      # on the GPU machine

Run by ``benchmarks/gpu_check.sh``. Each stage is a child process (its own process group,
killed when its budget runs out) that writes its log, and where it has figures a JSON file,
under ``--out``; a stage that fails or runs out of time loses only itself. Every budget is
also cut to what is left of ``--total`` (default 530 s, under the 9 minutes the script may
take), and a stage with less than ``MIN_BUDGET_S`` left is skipped, so the summary is always
written. At the end ``--out`` holds:

* ``summary.txt``: the table to paste into a note (stages, then each stage's figures);
* ``results.json``: every figure (``SCHEMA_VERSION``; ``stages`` in order, each with its
  ``status`` "ok", "failed", "timeout" or "skipped", ``seconds``, ``budget_s``,
  ``returncode``, ``log`` and ``results``, the stage's JSON or None);
* ``<stage>.log`` and ``<stage>.json`` of each stage.

The stages ``gpu_check.sh`` runs (``DEFAULT``): the environment; the kernel, layer and
fused-optimizer tests compiled for the GPU (they interpret Pallas only where there is no
GPU); ``benchmarks.tune_gpu`` (``impl="auto"``'s table, merged afterwards with ``--merge``);
``benchmarks.attention --gpu`` (flash attention's TFLOP/s against cuDNN);
``benchmarks.gpu_trainer`` (tokens/s and MFU, at 124M and at 1B parameters). Measured on
the first GPU run and rerun by name with ``--only``: ``benchmarks.kernels``,
``benchmarks.shared_prefix``,
``benchmarks.gpu_determinism``, ``benchmarks.embedding_backward`` under XLA's deterministic
flags, ``benchmarks.remat`` (XLA's temporary bytes per remat policy),
``benchmarks.finetune_mesh``, ``benchmarks.post_train``. Exit code 0 when every stage is
"ok".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
STATUSES = ("ok", "failed", "timeout", "skipped")
# A stage with less time than this left is skipped rather than started to be killed.
MIN_BUDGET_S = 10.0
# Kept back from the total for writing the summary.
RESERVE_S = 5.0


@dataclasses.dataclass(frozen=True)
class Stage:
    """One child process of the check.

    Attributes:
      name: the stage's name, also the stem of its files under ``--out``.
      budget_s: the most seconds it may run.
      command: its argv; ``{out}`` is replaced by the output folder, ``{python}`` by this
        interpreter.
      results: reads the stage's figures from the output folder (None: none to read).
    """

    name: str
    budget_s: float
    command: tuple[str, ...]
    results: Callable[[Path], dict[str, Any] | None] | None = None


def _json_file(name: str) -> Callable[[Path], dict[str, Any] | None]:
    def read(out: Path) -> dict[str, Any] | None:
        path = out / f"{name}.json"
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    return read


def _junit(out: Path) -> dict[str, Any] | None:
    """pytest's counts from its JUnit XML."""
    try:
        root = ET.parse(out / "tests.xml").getroot()
    except (FileNotFoundError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    counts: dict[str, Any] = {
        k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")
    }
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed_tests"] = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return counts


# What gpu_check.sh runs (issue 42's measurements): the others were measured on the first GPU
# run (docs/gpu_results.md) and rerun by name, --only kernels,determinism,...
DEFAULT = ("env", "tests", "tune", "attention", "trainer", "trainer_1b")


def default_stages() -> list[Stage]:
    """The stages gpu_check.sh runs, in order: ``DEFAULT``."""
    stages = {s.name: s for s in all_stages()}
    return [stages[name] for name in DEFAULT]


def all_stages() -> list[Stage]:
    py = "{python}"
    env = (
        "import json, jax, flax, optax, orbax.checkpoint as ocp, sys; "
        "print(json.dumps(dict(python=sys.version.split()[0], jax=jax.__version__, "
        "flax=flax.__version__, optax=optax.__version__, orbax=ocp.__version__, "
        "backend=jax.default_backend(), devices=[str(d) for d in jax.devices()])))"
    )
    return [
        Stage(
            "env",
            20,
            ("bash", "-c", f"nvidia-smi -L; {py} -c '{env}' | tee {{out}}/env.json"),
            _json_file("env"),
        ),
        # 952 tests, most compiling a kernel for the GPU: 8 xdist workers share the GPU
        # (no preallocation, so each takes only what it uses) and the 16 host cores. The
        # tests compare fp32 arithmetic with float64 references at fp32's tolerances; a GPU's
        # default fp32 matmul is TF32 (32 tests failed on an H200 for that alone), so they
        # run at the precision they check.
        Stage(
            "tests",
            130,
            (
                "env",
                "XLA_PYTHON_CLIENT_PREALLOCATE=false",
                "JAX_DEFAULT_MATMUL_PRECISION=highest",
                py,
                "-m",
                "pytest",
                "-q",
                "-n",
                "8",
                "-p",
                "no:cacheprovider",
                "--junitxml",
                "{out}/tests.xml",
                "tests/kernels",
                "tests/optim/test_fused_adamw.py",
                "tests/optim/test_update_and_apply.py",
                "tests/layers",
            ),
            _junit,
        ),
        # impl="auto"'s table: each kernel's Pallas and XLA arms at Llama-8B's sizes first
        # (benchmarks/tune_gpu.py); merged into rudax/kernels/auto_table.json afterwards, on
        # the machine that commits, with python -m benchmarks.tune_gpu --merge.
        Stage(
            "tune",
            180,
            (py, "-m", "benchmarks.tune_gpu", "--budget-s", "145", "--out", "{out}/tune.json"),
            _json_file("tune"),
        ),
        # Flash attention: TFLOP/s of the Pallas kernels against cuDNN, causal and packed.
        Stage(
            "attention",
            35,
            (
                py,
                "-m",
                "benchmarks.attention",
                "--gpu",
                "--rounds",
                "3",
                "--iters",
                "3",
                "--json",
                "{out}/attention.json",
            ),
            _json_file("attention"),
        ),
        Stage(
            "kernels",
            55,
            (
                py,
                "-m",
                "benchmarks.kernels",
                "--rounds",
                "5",
                "--iters",
                "3",
                "--json",
                "{out}/kernels.json",
            ),
            _json_file("kernels"),
        ),
        Stage(
            "trainer",
            60,
            (py, "-m", "benchmarks.gpu_trainer", "--json", "{out}/trainer.json"),
            _json_file("trainer"),
        ),
        # A 1B-class Llama (issue 42: measured besides the 124M one), fewer timed updates.
        Stage(
            "trainer_1b",
            55,
            (
                py,
                "-m",
                "benchmarks.gpu_trainer",
                "--preset",
                "1b",
                "--steps",
                "5",
                "--json",
                "{out}/trainer_1b.json",
            ),
            _json_file("trainer_1b"),
        ),
        Stage(
            "determinism",
            40,
            (py, "-m", "benchmarks.gpu_determinism", "--json", "{out}/determinism.json"),
            _json_file("determinism"),
        ),
        Stage(
            "embedding",
            15,
            (
                py,
                "-m",
                "benchmarks.embedding_backward",
                "--deterministic",
                "--json",
                "{out}/embedding.json",
            ),
            _json_file("embedding"),
        ),
        # Does XLA:GPU keep an unrolled loop's remat (XLA:CPU compiles it away)? temp bytes
        # and step time, unrolled and scanned, without remat and with "full", for the
        # default model and one 2x as deep.
        Stage(
            "remat",
            25,
            (
                py,
                "-m",
                "benchmarks.remat",
                "--policies",
                "full",
                "--deep-factor",
                "2",
                "--rounds",
                "3",
                "--iters",
                "3",
                "--json",
                "{out}/remat.json",
            ),
            _json_file("remat"),
        ),
        # examples.finetune's step through its mesh path at fsdp=1 against the plain step:
        # what the sharded path costs on one device (issue 30).
        Stage(
            "finetune_mesh",
            25,
            (
                py,
                "-m",
                "benchmarks.finetune_mesh",
                "--rounds",
                "3",
                "--iters",
                "2",
                "--json",
                "{out}/finetune_mesh.json",
            ),
            _json_file("finetune_mesh"),
        ),
        # One prompt and 8 completions, forward + backward of 2 SmolLM-shaped layers: the
        # shared row (branch_ids, the Pallas kernels) against 8 unshared rows (issue 38).
        Stage(
            "shared_prefix",
            25,
            (
                py,
                "-m",
                "benchmarks.shared_prefix",
                "--json",
                "{out}/shared_prefix.json",
                "training",
                "--rounds",
                "3",
            ),
            _json_file("shared_prefix"),
        ),
        # A GRPO iteration (sampling G=8 completions of 128 from a 512-token prompt, then a
        # training step) with the prompt shared against repeated (issue 41).
        Stage(
            "post_train",
            30,
            (
                py,
                "-m",
                "benchmarks.post_train",
                "--json",
                "{out}/post_train.json",
                "grpo",
                "--rounds",
                "2",
            ),
            _json_file("post_train"),
        ),
    ]


def run_stage(stage: Stage, out: Path, budget_s: float) -> dict[str, Any]:
    """Runs one stage for at most ``budget_s``; its record for results.json."""
    log = out / f"{stage.name}.log"
    argv = [a.format(out=out, python=sys.executable) for a in stage.command]
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {' '.join(argv)}  (budget {budget_s:.0f} s)\n")
        f.flush()
        child = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode: int | None = child.wait(timeout=budget_s)
            status = "ok" if returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the stage and any process it started
            child.wait()
            returncode, status = None, "timeout"
    record = _record(stage, status, time.monotonic() - start, budget_s, returncode, log)
    record["results"] = stage.results(out) if stage.results is not None else None
    return record


def _record(
    stage: Stage, status: str, seconds: float, budget_s: float, rc: int | None, log: Path | None
) -> dict[str, Any]:
    return {
        "name": stage.name,
        "status": status,
        "seconds": round(seconds, 2),
        "budget_s": round(budget_s, 2),
        "returncode": rc,
        "log": None if log is None else log.name,
        "results": None,
    }


def run(
    stages: Sequence[Stage], out: Path, total_s: float, *, min_budget_s: float = MIN_BUDGET_S
) -> dict[str, Any]:
    """Every stage in order within ``total_s``; writes results.json and summary.txt."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    records = []
    for stage in stages:
        left = total_s - RESERVE_S - (time.monotonic() - start)
        budget = min(stage.budget_s, left)
        if budget < min_budget_s:
            records.append(_record(stage, "skipped", 0.0, max(budget, 0.0), None, None))
            continue
        records.append(run_stage(stage, out, budget))
    results = {
        "schema_version": SCHEMA_VERSION,
        "total_budget_s": total_s,
        "seconds": round(time.monotonic() - start, 2),
        "stages": records,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "summary.txt").write_text(summary(results))
    return results


# --------------------------------------------------------------------------- summary


def summary(results: dict[str, Any]) -> str:
    """The table for a note: the stages, then each stage's figures."""
    lines = [
        f"GPU check: {results['seconds']:.0f} s of {results['total_budget_s']:.0f} s",
        "",
        "| stage | status | seconds | budget |",
        "|---|---|---|---|",
    ]
    for r in results["stages"]:
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.0f} | {r['budget_s']:.0f} |")
    by_name = {r["name"]: r.get("results") for r in results["stages"]}
    for name, fmt in _FIGURES.items():
        if by_name.get(name):
            lines += ["", *fmt(by_name[name])]
    return "\n".join(lines) + "\n"


def _env(r: dict[str, Any]) -> list[str]:
    versions = ", ".join(f"{k} {r.get(k)}" for k in ("python", "jax", "flax", "optax", "orbax"))
    return [f"{versions}; {', '.join(r.get('devices', []))}"]


def _tests(r: dict[str, Any]) -> list[str]:
    lines = [f"tests: {r['passed']} passed, {r['failures']} failed, {r['errors']} errors, "
             f"{r['skipped']} skipped"]  # fmt: skip
    return lines + [f"  failed: {name}" for name in r.get("failed_tests", [])[:20]]


def _attention(r: dict[str, Any]) -> list[str]:
    lines = [f"flash attention ({r.get('device')}), B=2 H=32 T=4096 K=128 bf16:", "",
             "| case | pass | arm | ms | TFLOP/s | speed vs cuDNN [min, max] |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for row in r.get("rows", []):
        s = row["speed_vs_cudnn"]
        lines.append(
            f"| {row['case']} | {row['kind']} | {row['arm']} | {row['ms']:.3f} | "
            f"{row['tflops']:.0f} | {s[0]:.3f}x [{s[1]:.3f}, {s[2]:.3f}] |"
        )
    return lines


def _kernels(r: dict[str, Any]) -> list[str]:
    from benchmarks.tune_gpu import table_lines  # jax's import, only for this table

    return [f"kernels ({r.get('device')}):", "", *table_lines(r.get("rows", []))]


def _tune(r: dict[str, Any]) -> list[str]:
    """benchmarks.tune_gpu's sweep, as the kernels' table (its rows are the same kind)."""
    from benchmarks.tune_gpu import table_lines  # jax's import, only for this table

    lines = [f"tune ({r['gpu']['name']}, for rudax/kernels/auto_table.json):", ""]
    lines += table_lines(r["groups"])
    lines += [f"failed: {arm}: {error}" for arm, error in r.get("failed", {}).items()]
    left = r.get("left_out") or []
    return lines + ([f"left out (budget): {'; '.join(left)}"] if left else [])


def _trainer(r: dict[str, Any]) -> list[str]:
    return [
        f"trainer ({r['preset']}, {r['parameters'] / 1e6:.1f}M parameters, "
        f"{r['tokens_per_update']} tokens/update, {r['device']}): {r['step_ms']:.1f} ms/update, "
        f"{r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}% of a measured bf16 "
        f"matmul peak of {r['bf16_matmul_peak_tflops']:.0f} TFLOP/s "
        f"(first update {r['first_step_s']:.1f} s)"
    ]


def _determinism(r: dict[str, Any]) -> list[str]:
    lines = [f"determinism ({r['preset']}, two fresh processes per arm):"]
    for arm, a in r["arms"].items():
        verdict = "bitwise" if a["bitwise"] else f"differs at update {a['first_differing_update']}"
        lines.append(
            f"  {arm}: {verdict} over {a['updates']} updates, {a['step_ms']:.2f} ms/update"
        )
    lines.append(f"  --deterministic step time: {r['deterministic_step_time_ratio']:.3f}x")
    return lines


def _embedding(r: dict[str, Any]) -> list[str]:
    lines = [f"embedding backward under XLA's deterministic flags (V={r['vocab']}, "
             f"D={r['features']}, {r['ids']} ids): ms, speed vs scatter"]  # fmt: skip
    for row in r["rows"]:
        speed = row["speed_vs_scatter"]
        lines.append(f"  {row['arm']}: {row['ms']:.3f} ms, {speed[0]:.3f}x [{speed[1]:.3f}, "
                     f"{speed[2]:.3f}]")  # fmt: skip
    return lines


def _remat(r: dict[str, Any]) -> list[str]:
    lines = ["remat: XLA temp bytes and step time, ratios vs unrolled none [min, max]", "",
             "| model | layout | policy | temp MB | temp vs none | step ms | step vs none |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in r["rows"]:
        step = row["step_vs_none"]
        lines.append(
            f"| {row['model']} | {row['layout']} | {row['policy']} | "
            f"{row['temp_bytes'] / 1e6:.1f} | "
            f"{row['temp_vs_none']:.3f} | {row['step_s'] * 1e3:.2f} | "
            f"{step[0]:.3f} [{step[1]:.3f}, {step[2]:.3f}] |"
        )
    return lines


def _finetune_mesh(r: dict[str, Any]) -> list[str]:
    med, lo, hi = r["ratio"]
    ms = {name: 1e3 * sorted(t)[len(t) // 2] for name, t in r["times_s"].items()}
    return [
        f"fine-tuner step ({r['platform']}): one device {ms['one device']:.1f} ms, mesh fsdp=1 "
        f"{ms['mesh fsdp=1']:.1f} ms; ratio {med:.3f} [{lo:.3f}, {hi:.3f}]"
    ]


def _post_train(r: dict[str, Any]) -> list[str]:
    from benchmarks.post_train import grpo_report  # jax's import, only for this table

    return grpo_report(r).splitlines()


_FIGURES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "env": _env,
    "tests": _tests,
    "attention": _attention,
    "kernels": _kernels,
    "tune": _tune,
    "trainer": _trainer,
    "trainer_1b": _trainer,
    "determinism": _determinism,
    "embedding": _embedding,
    "remat": _remat,
    "finetune_mesh": _finetune_mesh,
    "post_train": _post_train,
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_results"))
    p.add_argument("--total", type=float, default=530.0, help="seconds for every stage")
    p.add_argument("--only", help=f"comma-separated stage names (default: {','.join(DEFAULT)})")
    args = p.parse_args(argv)
    stages = default_stages()
    if args.only:
        stages = all_stages()
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {s.name for s in stages})
        if unknown:
            p.error(f"--only: unknown stages {unknown}; known: {[s.name for s in stages]}")
        stages = [s for s in stages if s.name in wanted]
    results = run(stages, Path(args.out), args.total)
    print((Path(args.out) / "summary.txt").read_text())
    return 0 if all(r["status"] == "ok" for r in results["stages"]) else 1


if __name__ == "__main__":
    sys.exit(main())
