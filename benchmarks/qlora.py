"""QLoRA benchmark: rudax NF4 and bf16 LoRA against transformers + peft, the same train step.

    python -m benchmarks.qlora                      # the table, 3 alternating rounds
    python -m benchmarks.qlora --prep --json b.json # + streamed preparation's memory
    python -m benchmarks.qlora --rounds 0 --prep    # the preparation part alone

One random Llama (``benchmarks.random_llama.write_random_llama``: bf16 safetensors, the
files ``save_pretrained`` writes) is written to a temporary directory and deleted after. Each
round runs every arm once, each in a fresh child process (so its peak memory is its own), in
an order that rotates round by round:

* ``rudax QLoRA``: ``rudax.models.from_pretrained(quantize="nf4", param_dtype=bf16,
  dtype=fp32)`` (every
  projection an ``NF4Linear``, the embedding, norms and head stored bf16), ``apply_lora`` on
  all seven projections, and the train step of ``examples/finetune/train.py`` (its
  ``make_steps``): ``micro``
  (``rudax.models.causal_lm_loss_sum``, ``nnx.value_and_grad`` over ``LoRAParam`` only,
  ``GradientAccumulator.add`` weighted by counted tokens) then ``apply`` (``pop``, global-norm
  clipping, AdamW on the fp32 adapters), one microbatch per update;
* ``rudax bf16 LoRA``: the same with ``quantize=None``: the base stored bf16, computed fp32;
* ``transformers + peft LoRA``: ``AutoModelForCausalLM.from_pretrained(dtype=float32)`` of
  the same directory (torch eager on the CPU, fp32 storage and compute: torch has no bf16
  storage with fp32 arithmetic), ``peft.get_peft_model`` with the same ``LoraConfig`` (rank,
  alpha, dropout, the seven targets), cross entropy over the same labels, ``backward``,
  ``clip_grad_norm_`` and ``torch.optim.AdamW`` over the adapters;
* ``bitsandbytes-4bit + peft QLoRA``: the same after ``from_pretrained`` with
  ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=float32)`` (bitsandbytes' CPU
  backend); the rest of the model fp32. If it fails here, its row gives the error.

The default size, d_model 512 x 4 layers (8 heads, 2 kv, MLP 1408), vocab 8192, 8 x 256
tokens per update (19.7M parameters, 11.3M of them in the projections), is the smallest at
which the matmuls, not per-op dispatch, set the step time (at d_model 128 torch's eager
overhead and XLA's launch cost decide), and 8 updates + start + compilation take about a
minute per arm-round on 2 shared cores, so 3 rounds of 4 arms fit in about 20 minutes.

Every arm trains on the same ids: ``B`` rows of ``T + 1`` random tokens, ``T`` inputs and
``T`` labels (the next token), ``B * T`` counted tokens per update. A child runs two untimed
updates (the first compiles), then times ``--steps`` updates, each waited for (its loss read
back, as the program does). Since LoRA's B starts at zero, the first update's loss is the
base's: the rudax and torch arms print the same value up to rounding, and each QLoRA arm
that of its dequantized base. Peak host memory is the child's ``ru_maxrss`` (the resident
high-water mark: libraries, mapped checkpoint pages, the model, compiled code or autograd
graphs) and its peak anonymous memory (``RssAnon`` of ``/proc/PID/status``, sampled every
millisecond by this parent process, so the child's own threads are not disturbed). Every
child runs with the trainer's glibc settings (``rudax.run.MALLOC_ENV``).

Base bytes are the frozen base as held: every array that is not an adapter (rudax: codes,
absmax and scales of each ``NF4Linear`` + the bf16 embedding, norms and head; bitsandbytes:
its packed weights and quantization state + the fp32 rest). The quantized part alone, the
seven projections, is reported beside it: that is the ratio QLoRA's 4 bits set (per 64
weights 32 bytes of codes and 1 of absmax code, per 16,384 one fp32 scale: 0.258 of bf16);
the embedding and head of a small-vocabulary model stay bf16 and weigh heavily in the whole.

``--prep`` writes a ~200M-parameter checkpoint (~400 MB bf16) and measures, in a fresh
process, the peak anonymous memory of ``from_pretrained(quantize="nf4")`` (the first load, cold:
the quantizer's compilation included, after JAX's CPU client started, measured alone; the
second, steady state) against the bound "the NF4 model + twice the largest tensor"
(tests/models/test_nf4_load.py asserts it at 25M parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("rudax_nf4", "rudax_bf16", "torch", "bnb")
LABELS = {
    "rudax_nf4": "rudax QLoRA (NF4 base, fp32 compute)",
    "rudax_bf16": "rudax bf16 LoRA (bf16 base, fp32 compute)",
    "torch": "transformers + peft LoRA (torch eager, CPU, fp32)",
    "bnb": "bitsandbytes-4bit + peft QLoRA (CPU, fp32 compute)",
}
BASELINE = "torch"
# The same names as rudax.models.PROJECTIONS (peft's target_modules); written out so the
# parent process and the torch arms need not import JAX.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# OpenMP threads (torch's, bitsandbytes') wait for work without spinning. With spinning waits,
# on a CPU shared with other processes every small op waits for a thread whose core another
# process holds: a 128 x 128 x 384 matmul + backward took 37-85 ms with 2 threads at load 8
# on 2 cores, 1.8-2.7 ms with passive waits, 1.1 ms on 1 thread. XLA's own pool is not OpenMP.
OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
TARGET_BYTES_RATIO = 0.27  # the issue's: NF4 base bytes / bf16 base bytes <= 0.27
TARGET_SPEED_RATIO = 1.0  # rudax QLoRA tokens/s / transformers + peft LoRA tokens/s >= 1


# ------------------------------------------------------------------------------- the model


def _config(args: argparse.Namespace, *, prep: bool = False):
    from benchmarks.random_llama import llama_config

    # The preparation's model has flags of its own, the same names under --prep-.
    flag = lambda name: getattr(args, f"prep_{name}" if prep else name)
    return llama_config(
        vocab_size=flag("vocab"),
        hidden_size=flag("d_model"),
        layers=flag("layers"),
        heads=flag("heads"),
        kv_heads=flag("kv_heads"),
        seq_len=2048 if prep else args.seq,
    )


def _ids(args: argparse.Namespace):
    """B rows of T + 1 token ids, the same in every arm."""
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, args.vocab, size=(args.batch, args.seq + 1), dtype=np.int64)


def _time_updates(update, steps: int) -> dict[str, float]:
    """Runs update() twice untimed (the first compiles), then times ``steps`` calls."""
    start = time.perf_counter()
    first = update()
    first_s = time.perf_counter() - start
    update()
    start = time.perf_counter()
    for _ in range(steps):
        update()
    return {
        "seconds": (time.perf_counter() - start) / steps,
        "first_loss": first,
        "first_s": first_s,
    }


# ------------------------------------------------------------------------------- the arms


def _rudax_arm(directory: Path, args: argparse.Namespace, quantize: str | None) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import rudax.layers as rl
    import rudax.models as rm
    import rudax.optim as ro
    import rudax.sharding as rs

    with jax.numpy_dtype_promotion("strict"):  # as the program runs
        model = rm.from_pretrained(
            directory, param_dtype=jnp.bfloat16, dtype=jnp.float32, quantize=quantize
        )
        rl.apply_lora(
            model,
            list(rm.PROJECTIONS),
            rank=args.rank,
            alpha=args.alpha,
            dropout=args.dropout,
            rngs=nnx.Rngs(0),
        )
        model.train()
        projection_bytes = sum(
            x.nbytes
            for _, m in nnx.iter_modules(model)
            if isinstance(m, rl.LoRALinear)
            for x in jax.tree.leaves(nnx.state(m.base))
        )
        graphdef, adapters, rngs, base = nnx.split(model, rl.LoRAParam, nnx.RngState, ...)
        base_bytes = sum(x.nbytes for x in jax.tree.leaves(base))

        # examples/finetune/train.py's step, with a constant learning rate.
        tx = optax.chain(ro.clip_by_global_norm(1.0), ro.adamw(args.lr, weight_decay=0.0))
        opt_state = tx.init(adapters)
        acc = ro.GradientAccumulator.init(adapters, jnp.float32)
        steps = rs.make_train_steps(graphdef, tx, rm.causal_lm_loss_sum)
        micro, apply = steps.micro, steps.apply

        ids = _ids(args)
        B, T = args.batch, args.seq
        batch = {
            "tokens": jnp.asarray(ids[:, :-1], jnp.int32),
            "labels": jnp.asarray(ids[:, 1:], jnp.int32),
            "segment_ids": jnp.ones((B, T), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
        }
        held = [adapters, rngs, opt_state, acc]

        def update() -> float:
            adapters, rngs, opt_state, acc = held
            acc, rngs, metrics = micro(adapters, rngs, acc, base, batch)
            adapters, opt_state, acc, _ = apply(adapters, opt_state, acc)
            held[:] = adapters, rngs, opt_state, acc
            m = jax.device_get(metrics)  # waits for the update, as the program does
            return float(m["ce_sum"]) / int(m["tokens"])

        timing = _time_updates(update, args.steps)
    return timing | {"base_bytes": base_bytes, "projection_bytes": projection_bytes}


def _torch_arm(directory: Path, args: argparse.Namespace, *, bnb: bool) -> dict[str, Any]:
    import peft
    import torch
    import transformers
    from peft.tuners.tuners_utils import BaseTunerLayer

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    kw: dict[str, Any] = {"dtype": torch.float32}
    if bnb:
        kw["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
        kw["device_map"] = "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, **kw)
    config = peft.LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=args.dropout,
        target_modules=list(PROJECTIONS),
    )
    model = peft.get_peft_model(model, config)
    model.train()
    base_bytes = projection_bytes = 0
    for name, module in model.named_modules():
        # A peft wrapper's ``weight`` is its base layer's, counted there; lora_A/B are trained.
        if isinstance(module, BaseTunerLayer) or "lora_" in name:
            continue
        if not isinstance(getattr(module, "weight", None), torch.Tensor):
            continue
        held = _torch_bytes(module)
        base_bytes += held
        if name.endswith(tuple(f"{p}.base_layer" for p in PROJECTIONS)):
            projection_bytes += held
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0)
    ids = torch.from_numpy(_ids(args))
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def update() -> float:
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return _time_updates(update, args.steps) | {
        "base_bytes": base_bytes,
        "projection_bytes": projection_bytes,
    }


def _torch_bytes(module) -> int:
    """Bytes of a module's own frozen weight and bias, with bitsandbytes' quantization state."""
    total = 0
    for p in (getattr(module, "weight", None), getattr(module, "bias", None)):
        if p is not None and not p.requires_grad:
            total += p.numel() * p.element_size()
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    while state is not None:  # absmax (uint8 with double quantization), code, then state2
        for t in (state.absmax, state.code, getattr(state, "offset", None)):
            if t is not None:
                total += t.numel() * t.element_size()
        state = getattr(state, "state2", None)
    return total


def _child(arm: str, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    try:
        if arm.startswith("rudax"):
            result = _rudax_arm(directory, args, "nf4" if arm == "rudax_nf4" else None)
        else:
            result = _torch_arm(directory, args, bnb=arm == "bnb")
    except Exception as e:  # bitsandbytes on a CPU it does not support: the row says why
        if arm != "bnb":
            raise
        return {"error": f"{type(e).__name__}: {e}"}
    return result | {
        "tokens_per_s": args.batch * args.seq / result["seconds"],
        "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


# ------------------------------------------------------------------------------- processes


def _status(pid: int | str, field: str) -> int | None:
    """A ``/proc/PID/status`` field in bytes, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _run_child(arm: str, directory: Path, argv: list[str], *, malloc_env: bool = True) -> dict:
    """Runs one arm in a fresh process, sampling its RssAnon every millisecond from here."""
    from rudax.run import MALLOC_ENV

    cmd = [sys.executable, "-m", "benchmarks.qlora", *argv]
    cmd += ["--child", arm, "--model-dir", str(directory)]
    env = dict(os.environ, **(MALLOC_ENV if malloc_env else {}), **OMP_ENV)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
        anon_peak = 0
        while proc.poll() is None:
            anon = _status(proc.pid, "RssAnon:")
            if anon is not None:
                anon_peak = max(anon_peak, anon)
            time.sleep(0.001)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"the {arm} child failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    if "error" not in result and arm != "prep":
        result["anon_peak_bytes"] = anon_peak
    return result


# ------------------------------------------------------------------------------- summary


def summarize(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each arm's medians and, per round, its ratios to the transformers + peft arm.

    Args:
      rounds: ``{arm: [one child's result per round]}``; a result is either ``{"error":
        message}`` or holds ``tokens_per_s``, ``maxrss_bytes``, ``anon_peak_bytes``,
        ``base_bytes``, ``projection_bytes`` and ``first_loss``. ``"torch"`` must have numbers.

    Returns:
      ``{"arms": {arm: {"error": ...} or {key: median, key + "_vs_torch": [median, min,
      max]}}, "nf4_over_bf16_base_bytes": ..., "nf4_over_bf16_projection_bytes": ...,
      "rudax_nf4_over_torch_tokens_per_s": [median, min, max]}``: ratios taken round by
      round (round i's arm over round i's baseline), then their median, min and max.

    Example:
      >>> r = lambda t, b: {"tokens_per_s": t, "maxrss_bytes": 1, "anon_peak_bytes": 1,
      ...                   "base_bytes": b, "projection_bytes": b, "first_loss": 9.0}
      >>> s = summarize({"rudax_nf4": [r(2, 1), r(3, 1)], "rudax_bf16": [r(1, 4), r(1, 4)],
      ...                "torch": [r(1, 8), r(2, 8)], "bnb": [{"error": "no"}]})
      >>> s["rudax_nf4_over_torch_tokens_per_s"], s["nf4_over_bf16_base_bytes"]
      ([1.75, 1.5, 2.0], 0.25)
    """
    from benchmarks._timing import ratio_summary

    keys = ("tokens_per_s", "maxrss_bytes", "anon_peak_bytes", "base_bytes", "projection_bytes")
    base = rounds[BASELINE]
    arms: dict[str, Any] = {}
    for arm, results in rounds.items():
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            arms[arm] = {"error": errors[0]}
            continue
        arms[arm] = {"first_loss": results[0]["first_loss"]}
        for key in keys:
            values = [r[key] for r in results]
            arms[arm][key] = statistics.median(values)
            arms[arm][f"{key}_vs_{BASELINE}"] = list(ratio_summary(values, [b[key] for b in base]))
    summary: dict[str, Any] = {"arms": arms}
    ok = lambda arm: arm in arms and "error" not in arms[arm]
    if ok("rudax_nf4"):
        summary["rudax_nf4_over_torch_tokens_per_s"] = arms["rudax_nf4"]["tokens_per_s_vs_torch"]
        if ok("rudax_bf16"):
            for key in ("base_bytes", "projection_bytes"):
                summary[f"nf4_over_bf16_{key}"] = arms["rudax_nf4"][key] / arms["rudax_bf16"][key]
    return summary


def _mib(x: float) -> str:
    return f"{x / 2**20:,.1f} MiB"


def _spread(r: list[float]) -> str:
    return f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]"


def table(summary: dict[str, Any]) -> str:
    """The markdown table of a ``summarize`` result: medians, and ratios to torch + peft."""
    lines = [
        "| arm | tokens/s | peak host memory (ru_maxrss; anonymous) | base bytes (projections) |",
        "|---|---|---|---|",
    ]
    for arm, s in summary["arms"].items():
        if "error" in s:
            lines.append(f"| {LABELS[arm]} | did not run: {s['error']} | | |")
            continue

        def v(key: str, s: dict[str, Any] = s, rel: bool = arm != BASELINE) -> str:
            return f" (x{_spread(s[key + '_vs_torch'])})" if rel else ""

        lines.append(
            f"| {LABELS[arm]} | {s['tokens_per_s']:,.0f}{v('tokens_per_s')} "
            f"| {_mib(s['maxrss_bytes'])}{v('maxrss_bytes')}; {_mib(s['anon_peak_bytes'])}"
            f"{v('anon_peak_bytes')} "
            f"| {s['base_bytes']:,} ({s['projection_bytes']:,}) |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------- --prep

# "start": JAX's CPU client alone (no load), so the cold first load's own share shows.
_PREP_PHASES = ("start", "first", "second")


def _prep_child(directory: Path) -> dict[str, Any]:
    """JAX's start, then two streamed NF4 loads, in this fresh process: each one's memory peak
    over the memory the process held when it began."""
    import gc

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import rudax.layers as rl
    from rudax.models import from_pretrained

    result: dict[str, Any] = {}
    for phase in _PREP_PHASES:
        gc.collect()
        peak, done = [0], threading.Event()

        def sample(peak=peak, done=done):
            while not done.is_set():
                peak[0] = max(peak[0], _status("self", "RssAnon:") or 0)
                time.sleep(0.001)

        with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here
            f.write("5")
        anon_before, rss_before = _status("self", "RssAnon:"), _status("self", "VmRSS:")
        assert anon_before is not None and rss_before is not None
        sampler = threading.Thread(target=sample)
        start = time.perf_counter()
        sampler.start()
        if phase == "start":
            model = jax.block_until_ready(jnp.zeros(()))
        else:
            model = from_pretrained(directory, param_dtype=jnp.bfloat16, quantize="nf4")
        done.set()
        sampler.join()
        seconds = time.perf_counter() - start
        anon_peak = max(peak[0], _status("self", "RssAnon:") or 0)
        result[phase] = {
            "seconds": seconds,
            "anon_peak_over_start": anon_peak - anon_before,
            "rss_peak_over_start": (_status("self", "VmHWM:") or 0) - rss_before,
        }
        if phase != "start":
            result["model_bytes"] = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
            result["quantized_bytes"] = sum(
                x.nbytes for x in jax.tree.leaves(nnx.state(model, rl.Quantized))
            )
        del model
    return result


def prep(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Writes the ~200M checkpoint, measures two loads in a fresh process, deletes it."""
    from benchmarks.random_llama import write_random_llama

    directory = Path(tempfile.mkdtemp(prefix="rudax-prep-bench-"))
    try:
        info = write_random_llama(directory, _config(args, prep=True))
        # glibc's default malloc here: the loader's own peak, not memory kept for reuse.
        measured = _run_child("prep", directory, argv, malloc_env=False)
    finally:
        shutil.rmtree(directory)
    bound = measured["model_bytes"] + 2 * info["largest_tensor_bytes"]
    return {
        "parameters": info["parameters"],
        "checkpoint_bytes": info["bytes"],
        "largest_tensor_bytes": info["largest_tensor_bytes"],
        "bound_bytes": bound,
        **measured,
    }


def prep_report(p: dict[str, Any]) -> str:
    lines = [
        f"streamed NF4 preparation: {p['parameters']:,} parameters, "
        f"{_mib(p['checkpoint_bytes'])} in bf16; NF4 model {_mib(p['model_bytes'])} "
        f"({_mib(p['quantized_bytes'])} of it NF4 storage); largest tensor "
        f"{_mib(p['largest_tensor_bytes'])}; bound (model + 2 x largest) {_mib(p['bound_bytes'])}",
        "| load | seconds | peak anonymous over start | / bound "
        "| peak RSS over start (file pages too) |",
        "|---|---|---|---|---|",
    ]
    for phase, label in zip(
        _PREP_PHASES,
        ("JAX's CPU client start, no load", "first load (cold: compilation)", "second (steady)"),
        strict=True,
    ):
        m = p[phase]
        lines.append(
            f"| {label} | {m['seconds']:.1f} | {_mib(m['anon_peak_over_start'])} "
            f"| {m['anon_peak_over_start'] / p['bound_bytes']:.3f} "
            f"| {_mib(m['rss_peak_over_start'])} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.qlora", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (0: --prep only)")
    p.add_argument("--steps", type=int, default=6, help="timed updates per arm per round")
    p.add_argument("--arms", type=lambda s: s.split(","), default=list(ARMS), help=",".join(ARMS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--dropout", type=float, default=0.05, help="the program's default")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--prep", action="store_true", help="also measure streamed preparation")
    p.add_argument("--prep-vocab", type=int, default=32000)
    p.add_argument("--prep-d-model", type=int, default=1024)
    p.add_argument("--prep-layers", type=int, default=12)
    p.add_argument("--prep-heads", type=int, default=16)
    p.add_argument("--prep-kv-heads", type=int, default=4)
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--child", choices=(*ARMS, "prep"), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints the table and returns every figure."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child == "prep":
        print(json.dumps(_prep_child(args.model_dir)))
        return {}
    if args.child:
        print(json.dumps(_child(args.child, args.model_dir, args)))
        return {}
    if args.rounds < 0 or args.steps < 1 or (args.rounds == 0 and not args.prep):
        parser.error("--rounds must be >= 1 (or 0 with --prep) and --steps >= 1")
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown or BASELINE not in args.arms:
        parser.error(
            f"--arms: {unknown or 'torch missing'}: choose from {','.join(ARMS)}, torch included"
        )
    report: dict[str, Any] = {"argv": argv, "cpus": os.cpu_count()}
    if args.rounds:
        config = _config(args)
        directory = Path(tempfile.mkdtemp(prefix="rudax-qlora-bench-"))
        rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in args.arms}
        try:
            from benchmarks.random_llama import write_random_llama

            info = write_random_llama(directory, config)
            names = list(args.arms)
            for r in range(args.rounds):
                for arm in names[r % len(names) :] + names[: r % len(names)]:
                    rounds[arm].append(_run_child(arm, directory, argv))
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            shutil.rmtree(directory)
        summary = summarize(rounds)
        report |= {"parameters": info["parameters"], "rounds": rounds, "summary": summary}
        print(
            f"\nLoRA r={args.rank} alpha={args.alpha:g} dropout={args.dropout:g} on all 7 "
            f"projections of a random Llama: {info['parameters']:,} parameters, {args.layers} x "
            f"{args.d_model} ({args.heads} heads, {args.kv_heads} kv, "
            f"MLP {config.intermediate_size}), "
            f"vocab {args.vocab}; batch {args.batch} x {args.seq} tokens, fp32 compute, AdamW "
            f"on the adapters; {os.cpu_count()} CPU threads; {args.rounds} alternating rounds "
            f"of {args.steps} timed updates, a fresh process per arm per round; medians, "
            f"ratios to transformers + peft as median [min, max] over rounds\n"
        )
        losses = ", ".join(
            f"{arm} {s['first_loss']:.5f}" for arm, s in summary["arms"].items() if "error" not in s
        )
        print(f"first update's loss (the base's): {losses}\n")
        print(table(summary))
        if "nf4_over_bf16_base_bytes" in summary:
            print(
                f"\nbase bytes, rudax NF4 / bf16: {summary['nf4_over_bf16_base_bytes']:.3f} for "
                f"the whole base (the bf16 embedding and head included), "
                f"{summary['nf4_over_bf16_projection_bytes']:.3f} for the quantized projections "
                f"(target <= {TARGET_BYTES_RATIO})"
            )
        if "rudax_nf4_over_torch_tokens_per_s" in summary:
            speed = summary["rudax_nf4_over_torch_tokens_per_s"]
            print(
                f"tokens/s, rudax QLoRA / transformers + peft LoRA: {_spread(speed)} "
                f"(target >= {TARGET_SPEED_RATIO})"
            )
    if args.prep:
        report["prep"] = prep(args, argv)
        print("\n" + prep_report(report["prep"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nevery figure: {args.json}")
    return report


if __name__ == "__main__":
    main()
