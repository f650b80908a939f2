"""Child process of tests/checkpoint/test_resume.py: a small real training run, cut and resumed.

    python _resume_worker.py first OUT          the straight run, then the first half of each cut
    python _resume_worker.py resume OUT CUT...  restores each cut's checkpoint, runs the rest

The run: a 2-layer MLP with bf16 parameters, ``fp32_master(chain(clip_by_global_norm,
adamw(warmup_cosine_decay_schedule)))``, a ``GradientAccumulator`` summing fp32 gradients of
``K`` token-weighted microbatches per update, dropout-like noise from an RNG key carried in
the caller state (split once per microbatch), and data that is a pure function of
(seed, microbatch index). Everything a resumed run needs comes from the checkpoint: the
parameters, the optimizer state (its count is the schedule's position), the pending
accumulator, the key and the data position.

Cuts: ``boundary`` saves after ``CUT_UPDATES`` updates (empty accumulator), with a sync
``Checkpointer``; ``mid_window`` saves ``MID_MICROBATCHES`` microbatches into the next window
(accumulator pending), with an async one. Results go to ``OUT/<name>.npz`` (every leaf's raw
bytes) and ``OUT/<name>.json`` (dtypes, shapes, and what the restored record held).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import rudax.checkpoint as rc
import rudax.optim as ro

SEED = 7
IN_FEATURES, HIDDEN, OUT_FEATURES = 8, 16, 4
MAX_ROWS = 8  # each microbatch holds 2..8 real rows: unequal token counts on purpose
K = 3  # microbatches per update
UPDATES = 4
CUT_UPDATES = 2
MID_MICROBATCHES = 2
KEEP_PROB = 0.75
CUTS = {"boundary": CUT_UPDATES * K, "mid_window": CUT_UPDATES * K + MID_MICROBATCHES}

schedule = ro.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=UPDATES)
tx = ro.fp32_master(optax.chain(ro.clip_by_global_norm(1.0), ro.adamw(schedule)))


def microbatch(index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, y padded to MAX_ROWS rows and the mask of real rows: a pure function of index."""
    rng = np.random.default_rng([SEED, index])
    rows = int(rng.integers(2, MAX_ROWS + 1))
    x = rng.normal(size=(MAX_ROWS, IN_FEATURES)).astype(np.float32)
    y = np.sin(x[:, :OUT_FEATURES] * 2.0).astype(np.float32)
    mask = (np.arange(MAX_ROWS) < rows).astype(np.float32)
    return x, y, mask


@jax.jit
def _init_arrays() -> tuple[Any, ...]:
    # One compiled function instead of dozens of eager ops: a child's start-up stays short.
    k1, k2 = jax.random.split(jax.random.key(SEED))
    params = {
        "w1": (jax.random.normal(k1, (IN_FEATURES, HIDDEN)) * 0.5).astype(jnp.bfloat16),
        "b1": jnp.zeros((HIDDEN,), jnp.bfloat16),
        "w2": (jax.random.normal(k2, (HIDDEN, OUT_FEATURES)) * 0.3).astype(jnp.bfloat16),
        "b2": jnp.zeros((OUT_FEATURES,), jnp.bfloat16),
    }
    acc = ro.GradientAccumulator.init(params, dtype=jnp.float32)
    return params, tx.init(params), acc, jax.random.key_data(jax.random.key(SEED + 1))


def init_record() -> rc.TrainingRecord:
    params, opt_state, acc, key_data = _init_arrays()
    state = {
        "rng": key_data,
        "microbatch": 0,  # the data position: the next microbatch's index
        "run": "resume-test",
    }
    return rc.TrainingRecord.capture(
        model=params, optimizer=opt_state, accumulator=acc, state=state
    )


def loss_sum(params, key, x_BxI, y_BxO, mask_B):
    """Sum over real rows of the squared error, with dropout on the hidden layer."""
    h_BxH = jnp.tanh(x_BxI.astype(jnp.bfloat16) @ params["w1"] + params["b1"])
    keep_BxH = jax.random.bernoulli(key, KEEP_PROB, h_BxH.shape)
    h_BxH = jnp.where(keep_BxH, h_BxH / jnp.bfloat16(KEEP_PROB), jnp.zeros_like(h_BxH))
    pred_BxO = (h_BxH @ params["w2"] + params["b2"]).astype(jnp.float32)
    return jnp.sum(jnp.sum((pred_BxO - y_BxO) ** 2, axis=-1) * mask_B)


@jax.jit
def accumulate(params, acc, key_data, x, y, mask):
    key, sub = jax.random.split(jax.random.wrap_key_data(key_data))
    loss, grads = jax.value_and_grad(loss_sum)(params, sub, x, y, mask)
    return acc.add(grads, weight=jnp.sum(mask)), loss, jax.random.key_data(key)


@jax.jit
def apply(params, opt_state, acc):
    grads, acc = acc.pop(normalize=True)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, acc


def train(record: rc.TrainingRecord, stop: int) -> tuple[rc.TrainingRecord, list[np.ndarray]]:
    """Runs microbatches from the record's data position up to ``stop``; an update every K."""
    params, opt_state, acc = record.model, record.optimizer, record.accumulator
    state = dict(record.state)
    losses = []
    for index in range(state["microbatch"], stop):
        acc, loss, state["rng"] = accumulate(params, acc, state["rng"], *microbatch(index))
        losses.append(np.asarray(loss))
        state["microbatch"] = index + 1
        if (index + 1) % K == 0:
            params, opt_state, acc = apply(params, opt_state, acc)
    return rc.TrainingRecord(params, opt_state, acc, state), losses


def write(out: Path, name: str, record: Any, losses: list[np.ndarray], info: dict) -> None:
    """Every array leaf's raw bytes to OUT/name.npz; dtypes, shapes and info to name.json."""
    arrays, layout = {}, {}
    leaves = jax.tree_util.tree_flatten_with_path({"record": record, "losses": losses})[0]
    for path, leaf in leaves:
        key = jax.tree_util.keystr(path)
        if isinstance(leaf, str | int):
            layout[key] = ["python", leaf]
            continue
        a = np.asarray(leaf)
        arrays[key] = np.frombuffer(a.tobytes(), np.uint8)
        layout[key] = [str(a.dtype), list(a.shape)]
    np.savez(out / f"{name}.npz", **arrays)
    (out / f"{name}.json").write_text(json.dumps({"layout": layout, "info": info}))


def first(out: Path) -> None:
    straight, losses = train(init_record(), UPDATES * K)
    write(out, "straight", straight, losses, {})
    for cut, stop in CUTS.items():
        part, losses = train(init_record(), stop)
        with rc.Checkpointer(out / f"ckpt_{cut}", async_save=cut == "mid_window") as ckpt:
            ckpt.save(stop, part)
        write(out, f"first_{cut}", {}, losses, {})


def resume(out: Path, cuts: list[str]) -> None:
    for cut in cuts:
        with rc.Checkpointer(out / f"ckpt_{cut}") as ckpt:
            step = ckpt.latest_step()
            restored = ckpt.restore(init_record())  # a fresh template: only its layout is used
        info = {
            "step": step,
            "microbatch": restored.state["microbatch"],
            "pending": int(restored.accumulator.count),
            "updates": int(restored.optimizer.inner_state[1][0].count),
        }
        final, losses = train(restored, UPDATES * K)
        write(out, f"resumed_{cut}", final, losses, info)


if __name__ == "__main__":
    mode, out_dir, *cuts = sys.argv[1:]
    if mode == "first" and not cuts:
        first(Path(out_dir))
    elif mode == "resume" and cuts and set(cuts) <= set(CUTS):
        resume(Path(out_dir), cuts)
    else:
        raise SystemExit(f"usage: first OUT | resume OUT CUT...; got {sys.argv[1:]}")
