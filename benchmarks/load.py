"""Loading a checkpoint onto a mesh: the whole load then ``shard`` against ``from_pretrained(...,
mesh=mesh)``, per process and per device.

    python -m benchmarks.load --dir /tmp/llama70b-2 --processes 2 --devices 4   # 70B's layers
    python -m benchmarks.load --dir /tmp/small --vocab 8192 --hidden 512 --intermediate 1792 \\
        --heads 8 --kv-heads 2 --json out.json

The checkpoint (written once under ``--dir`` by ``benchmarks.random_llama``, bf16) has by
default Llama-3-70B's layer shapes: hidden 8192, 64 query and 8 key-value heads, intermediate
28672, vocabulary 128256, untied head; two layers (7.6 GB). Each arm runs as ``--processes``
fresh processes joined by ``jax.distributed`` on localhost, with ``--devices`` simulated CPU
devices each, all on one ``fsdp`` axis:

* ``whole``: ``from_pretrained(dir)`` (every process reads every tensor onto its first device),
  then ``rudax.models.shard``: today's path before this change;
* ``sharded``: ``from_pretrained(dir, mesh=mesh)``: each process reads its devices' slices.

Each process reports the peak of its anonymous resident memory over its start (RssAnon,
sampled every millisecond: the file pages read are page cache, which the kernel reclaims, so
they are left out) and the bytes each of its devices holds at the end; the whole arm also the
bytes its first device held before sharding. The bound is the issue's: the process's share of
the model plus one tensor's slice (the largest tensor over the processes).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_ARMS = ("whole", "sharded")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _child(args: argparse.Namespace) -> dict[str, Any]:
    """One process of one arm: load, measure, and (small models) the logits."""
    import jax
    import numpy as np
    from flax import nnx

    import rudax.run as rr

    rr.initialize_distributed()
    devices = np.array(jax.devices())
    mesh = jax.sharding.Mesh(devices, ("fsdp",))
    quantize = None if args.quantize == "none" else args.quantize
    if args.warmup:  # compiles what the load compiles, so the measure holds only arrays
        _load(args.child, args.dir, quantize, mesh)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    start = _status("RssAnon")
    peak, done = [start], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _status("RssAnon"))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    began = time.perf_counter()
    model, first_device = _load(args.child, args.dir, quantize, mesh)
    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - began
    done.set()
    sampler.join()
    peak[0] = max(peak[0], _status("RssAnon"))
    held: dict[int, int] = {}
    for x in leaves:
        for s in x.addressable_shards:
            held[s.device.id] = held.get(s.device.id, 0) + s.data.nbytes
    return {
        "process": jax.process_index(),
        "seconds": seconds,
        "anon_peak_over_start": peak[0] - start,
        "device_bytes": held,
        "first_device_bytes_before_shard": first_device,
        "model_bytes": sum(x.nbytes for x in leaves),
    }


def _load(arm: str, directory: Path, quantize: str | None, mesh: Any) -> tuple[Any, int]:
    """The sharded model by the arm's path, and the bytes its first device held on the way."""
    import jax
    from flax import nnx

    import rudax.models as rm
    import rudax.sharding as rs

    if arm == "sharded":
        return rm.from_pretrained(directory, quantize=quantize, mesh=mesh), 0
    whole = rm.from_pretrained(directory, quantize=quantize)
    first_device = sum(x.nbytes for x in jax.tree.leaves(nnx.state(whole)))
    return rm.shard(whole, rs.ShardingContext(mesh, "fsdp")), first_device


def run_arm(
    arm: str,
    directory: Path,
    processes: int,
    devices: int,
    quantize: str,
    timeout: float,
    warmup: bool = False,
) -> list[dict[str, Any]]:
    """The arm's per-process results, each process a fresh interpreter."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(var, None)
    outs, procs = [], []
    for i in range(processes):
        e = dict(env)
        if processes > 1:
            e.update(
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES=str(processes),
                JAX_PROCESS_ID=str(i),
            )
        out = directory.parent / f".{directory.name}.{arm}.{i}.json"
        out.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "benchmarks.load", "--dir", str(directory)]
        argv += ["--child", arm, "--child-out", str(out), "--quantize", quantize]
        argv += ["--warmup"] if warmup else []
        procs.append(subprocess.Popen(argv, env=e, cwd=ROOT, start_new_session=True))
        outs.append(out)
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"arm {arm}: process {bad[0][0]} exited with {bad[0][1]}")
    results = [json.loads(o.read_text()) for o in outs]
    for o in outs:
        o.unlink()
    return results


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="the checkpoint (written if absent)")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--devices", type=int, default=4, help="simulated CPU devices per process")
    p.add_argument("--quantize", choices=("none", "nf4"), default="none")
    p.add_argument("--arms", default=",".join(_ARMS))
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--intermediate", type=int, default=28672)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument(
        "--warmup", action="store_true", help="load once before the measured load (compiles)"
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", choices=_ARMS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    if args.child is not None:
        result = _child(args)
        args.child_out.write_text(json.dumps(result))
        return result
    from benchmarks.random_llama import llama_config, write_random_llama

    config = llama_config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate_size=args.intermediate,
    )
    info_file = args.dir / "benchmark_info.json"
    if not info_file.is_file():
        info = write_random_llama(args.dir, config)
        info_file.write_text(json.dumps(info))
    info = json.loads(info_file.read_text())
    arms = {}
    for arm in args.arms.split(","):
        arms[arm] = run_arm(
            arm, args.dir, args.processes, args.devices, args.quantize, args.timeout, args.warmup
        )
    n = args.processes * args.devices
    out = {
        "checkpoint": {
            "bytes": info["bytes"],
            "largest_tensor_bytes": info["largest_tensor_bytes"],
        },
        "processes": args.processes,
        "devices_per_process": args.devices,
        "quantize": args.quantize,
        "arms": arms,
    }
    print(f"checkpoint {info['bytes'] / 2**20:.0f} MiB bf16, largest tensor "
          f"{info['largest_tensor_bytes'] / 2**20:.0f} MiB; {args.processes} processes x "
          f"{args.devices} devices (fsdp={n}); quantize={args.quantize}")  # fmt: skip
    print("| arm | process | peak anon over start (MiB) | its share of the model (MiB) | "
          "bound: share + largest/P (MiB) | max device (MiB) | seconds |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for arm, results in arms.items():
        for r in results:
            share = sum(r["device_bytes"].values())
            bound = share + info["largest_tensor_bytes"] / args.processes
            device = max(max(r["device_bytes"].values()), r["first_device_bytes_before_shard"])
            print(f"| {arm} | {r['process']} | {r['anon_peak_over_start'] / 2**20:.0f} | "
                  f"{share / 2**20:.0f} | {bound / 2**20:.0f} | {device / 2**20:.0f} | "
                  f"{r['seconds']:.1f} |")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
