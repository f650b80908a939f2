"""Checkpoint benchmark: save and restore MB/s of a ~1 GB training state against raw disk I/O.

The state is a ``rudax.checkpoint.TrainingRecord`` shaped like a real run's: bf16 parameters
in a few big matrices (plus small biases), the ``fp32_master(adamw)`` optimizer state (fp32
masters and both moments: 6 of every 7 bytes), the step counts and a caller state, filled with
random normal values (orbax's default zstd still shrinks those by ~10%, their exponent bytes
being far from random). Each round measures, in rotating order within each group, on fresh
files in one directory:

- writes: raw write (every leaf's bytes into one file, then ``fsync``), plain orbax
  (``CheckpointManager`` with ``StandardSave`` of the same arrays, sync and async), a sync
  ``Checkpointer.save`` (until committed), and an async save: the time until ``save()``
  returns (what the train loop waits for) and until ``wait()`` returns (committed);
- warm reads, right after the writes: raw read of the file into a new buffer, plain orbax's
  ``StandardRestore`` and ``Checkpointer.restore`` of the sync checkpoints
  (``block_until_ready``), and ``restore`` after the caller freed a template of live arrays
  (what donating the template's memory to the restore could at best give back);
- fresh memory: allocating and touching as many bytes, the cost every read arm pays too;
- cold reads: the same after emptying the page cache: ``sync; echo 3 >
  /proc/sys/vm/drop_caches`` where the benchmark may (as root), else
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file after ``fsync`` (the table says which);
- step 0: the same state as a run's first checkpoint holds it (AdamW's moments zero, the
  masters the parameters), saved and restored with every leaf written and with
  ``zeros_as_metadata=True``, against a checkpoint of the parameters alone.

The table gives each arm's median seconds and MB/s (MB = 10**6 bytes of array data), and each
checkpoint arm's throughput relative to the raw arm of the same kind *in the same round*,
median [min, max] over rounds; the async blocking time is given as a fraction of the sync
save's. orbax (tensorstore) fsyncs what it writes, as the raw arm does.

    python -m benchmarks.checkpoint                        # --gb 1.0 --rounds 3
    python -m benchmarks.checkpoint --gb 0.05 --rounds 1   # a quick look, seconds
    python -m benchmarks.checkpoint --dir /mnt/fast --json results.json
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import rudax.checkpoint as rc
import rudax.optim as ro
from benchmarks._timing import ratio_summary

MB = 1e6
COLS = 1024  # columns of every big matrix
BYTES_PER_PARAM = 2 + 3 * 4  # bf16 parameter + fp32 master, exp_avg, exp_avg_sq
WRITES = (
    "raw write+fsync",
    "orbax save (sync)",
    "orbax save (async)",
    "save (sync)",
    "save (async)",
)
READS = ("raw read", "orbax restore", "restore")
FREED = "restore (template freed)"
ASYNC = ("orbax save (async)", "save (async)")
STEP0 = ("step 0", "step 0 zeros_as_metadata", "params only")


def build_record(gb: float, seed: int) -> rc.TrainingRecord:
    """A record of about ``gb`` * 10**9 bytes, every floating leaf random."""
    rows = max(int(gb * 1e9 / BYTES_PER_PARAM / COLS), 4)
    layout = {
        "embed": jax.ShapeDtypeStruct((rows // 2, COLS), jnp.bfloat16),
        "mlp_in": jax.ShapeDtypeStruct((rows // 4, COLS), jnp.bfloat16),
        "mlp_out": jax.ShapeDtypeStruct((rows - rows // 2 - rows // 4, COLS), jnp.bfloat16),
        "norm": jax.ShapeDtypeStruct((COLS,), jnp.bfloat16),
        "bias": jax.ShapeDtypeStruct((COLS,), jnp.bfloat16),
    }
    tx = ro.fp32_master(ro.adamw(1e-3))
    rng = np.random.default_rng(seed)

    def fill(like: jax.ShapeDtypeStruct) -> jax.Array:
        if jnp.issubdtype(like.dtype, jnp.floating):
            x = rng.standard_normal(like.shape, dtype=np.float32).astype(like.dtype)
        else:
            x = np.full(like.shape, 1000, like.dtype)  # a step count
        return jax.device_put(x)

    model = jax.tree.map(fill, layout)
    optimizer = jax.tree.map(fill, jax.eval_shape(tx.init, layout))
    state = {"rng": jax.random.key_data(jax.random.key(seed)), "data_position": 123, "run": "b"}
    return rc.TrainingRecord.capture(model=model, optimizer=optimizer, state=state)


def step0_record(record: rc.TrainingRecord) -> rc.TrainingRecord:
    """record as at step 0: the same parameters and masters, AdamW's moments all zero."""

    def fresh(path: tuple, x: object) -> object:
        moment = "exp_avg" in jax.tree_util.keystr(path)
        return jnp.zeros_like(x) if moment and isinstance(x, jax.Array) else x

    optimizer = jax.tree_util.tree_map_with_path(fresh, record.optimizer)
    return rc.TrainingRecord.capture(model=record.model, optimizer=optimizer, state=record.state)


def drop_page_cache() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False where this process may not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def host_views(record: rc.TrainingRecord) -> list[np.ndarray]:
    """Every array leaf as contiguous host bytes: what the raw arms write and read."""
    leaves = [x for x in jax.tree.leaves(record) if isinstance(x, jax.Array)]
    return [np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8) for x in leaves]


def raw_write(path: Path, views: list[np.ndarray]) -> None:
    with open(path, "wb", buffering=0) as f:
        for v in views:
            f.write(memoryview(v))
        os.fsync(f.fileno())


def raw_read(path: Path, nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes, np.uint8)
    view, done = memoryview(buf), 0
    with open(path, "rb", buffering=0) as f:
        while done < nbytes:  # one read() returns at most ~2 GiB on Linux
            n = f.readinto(view[done:])
            if not n:
                raise OSError(f"{path}: {done} of {nbytes} bytes, then end of file")
            done += n
    return buf


def evict(path: Path) -> None:
    """Drops the file (or every file under the directory) from the kernel's page cache."""
    files = [path] if path.is_file() else [Path(d, f) for d, _, fs in os.walk(path) for f in fs]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_bytes(path: Path) -> int:
    return sum(Path(d, f).stat().st_size for d, _, fs in os.walk(path) for f in fs)


def assert_same(restored: rc.TrainingRecord, record: rc.TrainingRecord, what: str) -> None:
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(record), strict=True):
        if isinstance(b, jax.Array) and np.asarray(a).tobytes() != np.asarray(b).tobytes():
            raise SystemExit(f"{what}: the restored record differs from the one saved")


def orbax_tree(record: rc.TrainingRecord) -> dict:
    """The record's arrays as plain orbax saves them: one ``StandardSave`` pytree."""
    return {"model": record.model, "optimizer": record.optimizer, "rng": record.state["rng"]}


def rotate(names: tuple[str, ...], r: int) -> tuple[str, ...]:
    return names[r % len(names) :] + names[: r % len(names)]


def one_round(here: Path, r: int, record, views, times: dict, *, check: bool) -> dict:
    """Every arm once, in round r's order; files go into ``here``, deleted at the end.

    Returns {"disk": bytes the sync checkpoint took, "step 0 disk": {arm: bytes}, "cold": how
    the page cache was emptied}.
    """
    nbytes = sum(v.nbytes for v in views)
    here.mkdir()
    raw = here / "raw.bin"
    ckpts = {
        "save (sync)": rc.Checkpointer(here / "sync", keep=1),
        "save (async)": rc.Checkpointer(here / "async", keep=1, async_save=True),
    }
    tree = orbax_tree(record)
    managers = {
        "orbax save (sync)": ocp.CheckpointManager(
            here / "orbax_sync",
            options=ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=False),
        ),
        "orbax save (async)": ocp.CheckpointManager(
            here / "orbax_async", options=ocp.CheckpointManagerOptions(max_to_keep=1)
        ),
    }
    try:
        for arm in rotate(WRITES, r):
            start = time.perf_counter()
            if arm == "raw write+fsync":
                raw_write(raw, views)
            elif arm in managers:
                managers[arm].save(r, args=ocp.args.StandardSave(tree))
                if arm in ASYNC:
                    times[f"{arm} blocking"].append(time.perf_counter() - start)
                managers[arm].wait_until_finished()
            else:
                ckpts[arm].save(r, record)
                if arm in ASYNC:
                    times[f"{arm} blocking"].append(time.perf_counter() - start)
                ckpts[arm].wait()
            times[arm].append(time.perf_counter() - start)
        start = time.perf_counter()
        fresh = np.ones(nbytes, np.uint8)  # allocating and touching, nothing else
        times["fresh memory"].append(time.perf_counter() - start)
        del fresh
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        cold = "posix_fadvise(DONTNEED)"
        for cache in ("warm", "cold"):
            if cache == "cold":
                evict(raw)
                evict(here / "sync")
                evict(here / "orbax_sync")
                if drop_page_cache():
                    cold = "drop_caches"
            for arm in rotate(READS, r):
                start = time.perf_counter()
                if arm == "raw read":
                    out = raw_read(raw, nbytes)
                elif arm == "orbax restore":
                    out = jax.block_until_ready(
                        managers["orbax save (sync)"].restore(
                            r, args=ocp.args.StandardRestore(abstract)
                        )
                    )
                else:
                    out = jax.block_until_ready(ckpts["save (sync)"].restore(record))
                times[f"{arm} ({cache})"].append(time.perf_counter() - start)
                if check and arm == "restore":
                    assert_same(out, record, f"restore ({cache})")
                del out
        # The template's memory given back before the restore, as a donated template's
        # would be: a copy of the record, made untimed, deleted first thing.
        template = jax.tree.map(lambda x: x + 0 if isinstance(x, jax.Array) else x, record)
        jax.block_until_ready(template)
        start = time.perf_counter()
        for x in jax.tree.leaves(template):
            if isinstance(x, jax.Array):
                x.delete()
        out = jax.block_until_ready(ckpts["save (sync)"].restore(abstract_record(record)))
        times[FREED].append(time.perf_counter() - start)
        del out, template
        if check:
            assert_same(ckpts["save (async)"].restore(record), record, "async save")
        step0_disk = step0_round(here, r, record, times, check=check)
        return {"disk": disk_bytes(here / "sync"), "step 0 disk": step0_disk, "cold": cold}
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
        for manager in managers.values():
            manager.close()
        shutil.rmtree(here)


def abstract_record(record: rc.TrainingRecord) -> rc.TrainingRecord:
    """record's arrays as ShapeDtypeStructs (no placement): a template that holds no memory."""
    struct = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x
    return jax.tree.map(struct, record)


def step0_round(here: Path, r: int, record, times: dict, *, check: bool) -> dict:
    """The step-0 arms, in round r's order: save, then restore (warm). {arm: disk bytes}."""
    records = {
        "step 0": step0_record(record),
        "params only": rc.TrainingRecord.capture(model=record.model, optimizer=()),
    }
    records["step 0 zeros_as_metadata"] = records["step 0"]
    disk = {}
    for arm in rotate(STEP0, r):
        with rc.Checkpointer(here / arm.replace(" ", "_"), zeros_as_metadata="zeros" in arm) as c:
            start = time.perf_counter()
            c.save(r, records[arm])
            times[f"{arm} save"].append(time.perf_counter() - start)
            start = time.perf_counter()
            out = jax.block_until_ready(c.restore(records[arm]))
            times[f"{arm} restore"].append(time.perf_counter() - start)
            if check:
                assert_same(out, records[arm], arm)
            del out
        disk[arm] = disk_bytes(here / arm.replace(" ", "_"))
    return disk


def summarize(times: dict, nbytes: int) -> list[dict]:
    """Rows of the table: arm, median s, MB/s, throughput ratios vs raw and vs plain orbax."""
    rows = []
    pairs = {  # arm: (its raw baseline, its plain-orbax baseline)
        "raw write+fsync": (None, None),
        "orbax save (sync)": ("raw write+fsync", None),
        "orbax save (async)": ("raw write+fsync", None),
        "save (sync)": ("raw write+fsync", "orbax save (sync)"),
        "save (async)": ("raw write+fsync", "orbax save (async)"),
        "raw read (warm)": (None, None),
        "orbax restore (warm)": ("raw read (warm)", None),
        "restore (warm)": ("raw read (warm)", "orbax restore (warm)"),
        "raw read (cold)": (None, None),
        "orbax restore (cold)": ("raw read (cold)", None),
        "restore (cold)": ("raw read (cold)", "orbax restore (cold)"),
    }
    for arm, (raw, orbax) in pairs.items():
        ts = times[arm]
        median = statistics.median(ts)
        row = {"arm": arm, "median_s": median, "mb_per_s": nbytes / MB / median}
        if raw is not None:  # throughput ratio: baseline time / arm time, per round
            row["vs_raw"] = ratio_summary(times[raw], ts)
        if orbax is not None:
            row["vs_orbax"] = ratio_summary(times[orbax], ts)
        rows.append(row)
    median = statistics.median(times[FREED])
    rows.append(
        {
            "arm": FREED,
            "median_s": median,
            "mb_per_s": nbytes / MB / median,
            "vs_orbax": ratio_summary(times["orbax restore (warm)"], times[FREED]),
            "vs_restore": ratio_summary(times["restore (warm)"], times[FREED]),
        }
    )
    median = statistics.median(times["fresh memory"])
    rows.append({"arm": "fresh memory", "median_s": median, "mb_per_s": nbytes / MB / median})
    for arm in STEP0:  # time ratios against the parameters alone (lower is better)
        for op in ("save", "restore"):
            name = f"{arm} {op}"
            row = {"arm": name, "median_s": statistics.median(times[name]), "mb_per_s": None}
            if arm != "params only":
                row["vs_params"] = ratio_summary(times[name], times[f"params only {op}"])
            rows.append(row)
    for arm in ASYNC:
        row = {
            "arm": f"{arm} blocking",
            "median_s": statistics.median(times[f"{arm} blocking"]),
            "mb_per_s": None,
        }
        if arm == "save (async)":  # blocking time ratio: rudax's / orbax's (lower is better)
            row["blocking_vs_orbax"] = ratio_summary(
                times["save (async) blocking"], times["orbax save (async) blocking"]
            )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="state size, 10**9 bytes")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: temp)")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.gb > 0 or args.rounds < 1:
        parser.error(f"--gb must be > 0 and --rounds >= 1, got {args.gb=}, {args.rounds=}")
    if args.dir is not None and not args.dir.is_dir():
        parser.error(f"--dir must be an existing directory, got {args.dir}")

    root = Path(tempfile.mkdtemp(prefix="rudax_ckpt_bench_", dir=args.dir))
    try:
        start = time.perf_counter()
        record = build_record(args.gb, args.seed)
        views = host_views(record)
        nbytes = sum(v.nbytes for v in views)
        print(
            f"jax {jax.__version__} on {jax.devices()[0].platform}; state {nbytes / MB:,.1f} MB "
            f"in {len(views)} arrays (bf16 params + fp32 masters and AdamW moments), built in "
            f"{time.perf_counter() - start:.1f} s; directory {root}; {args.rounds} rounds"
        )
        # Untimed: a small save and restore first, so no arm pays orbax's first-call costs.
        warm = build_record(0.002, args.seed)
        one_round(root / "warmup", 0, warm, host_views(warm), _empty_times(), check=True)
        times, rounds = _empty_times(), []
        for r in range(args.rounds):
            # The first round also checks that each restore returns the bytes saved.
            rounds.append(one_round(root / f"round{r}", r, record, views, times, check=r == 0))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows = summarize(times, nbytes)
    overhead = statistics.median(r["disk"] for r in rounds) / nbytes
    cold = sorted({r["cold"] for r in rounds})
    step0_disk = {arm: statistics.median(r["step 0 disk"][arm] for r in rounds) for arm in STEP0}
    fmt = lambda r: "" if r is None else f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]"
    print(f"\n{'arm':<32} {'median s':>9} {'MB/s':>7}   {'vs raw':<22} {'vs plain orbax':<22}")
    for row in rows:
        mbps = "" if row["mb_per_s"] is None else f"{row['mb_per_s']:,.0f}"
        other = row.get("vs_orbax") or row.get("blocking_vs_orbax") or row.get("vs_params")
        print(
            f"{row['arm']:<32} {row['median_s']:>9.3f} {mbps:>7}   "
            f"{fmt(row.get('vs_raw')):<22} {fmt(other):<22}"
        )
    print(
        "\nnotes: ratios are throughput vs the raw arm and vs plain orbax (CheckpointManager,"
        " StandardSave of the same arrays) of the same round (baseline time / arm time),"
        " median [min, max] over rounds; the blocking row is rudax's blocking time over"
        " orbax's (lower is better).\n"
        f"- checkpoint on disk: {overhead:.3f}x the array bytes (zstd, orbax's default, and"
        " metadata).\n"
        "- warm reads come right after the writes, from the page cache, for both arms alike:"
        " they measure memory and deserialization, not the disk.\n"
        f"- cold reads follow {' and '.join(cold)} (posix_fadvise(DONTNEED) on every file, then"
        " drop_caches where permitted); on a virtual machine the host may still cache the"
        " disk, so 'cold' can beat the physical device.\n"
        f"- {FREED}: the template's arrays deleted just before the restore, timed with it;"
        " its last column is throughput vs plain orbax (and vs_restore in the JSON).\n"
        "- step-0 rows: the last column is the arm's time over the 'params only' arm's"
        " (lower is better); on disk: "
        + ", ".join(f"{arm} {step0_disk[arm] / MB:,.0f} MB" for arm in STEP0)
        + ".\n"
        "- both read arms allocate new memory for what they read, as a restore must; 'fresh"
        " memory' is what allocating and touching that much costs alone (on a VM whose host"
        " reclaims freed pages it can dominate every arm).\n"
        "- on CPU a jax.Array already lives in host memory: the async save's blocking time is"
        " orbax's bookkeeping and a host view of each shard, not a device-to-host transfer;"
        " the checksums are computed from those views in the background, inside orbax's"
        " commit (rudax/checkpoint/_meta_handler.py)."
    )
    if args.json is not None:
        result = {"args": {k: str(v) for k, v in vars(args).items()}, "bytes": nbytes}
        result.update(rows=rows, times=times, rounds=rounds)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


def _empty_times() -> dict[str, list]:
    names = [*WRITES, *(f"{arm} blocking" for arm in ASYNC), "fresh memory", FREED]
    names += [f"{arm} {op}" for arm in STEP0 for op in ("save", "restore")]
    names += [f"{arm} ({cache})" for cache in ("warm", "cold") for arm in READS]
    return {name: [] for name in names}


if __name__ == "__main__":
    main()
