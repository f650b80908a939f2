"""Quickstart: a small MLP trained with rudax.optim, the way a real run is put together.

bf16 parameter storage with FP32 master weights, AdamW with PyTorch's defaults, a learning
rate halved every 100 updates, global-norm clipping, and token-weighted gradient accumulation
over microbatches of unequal size (so each update's gradient is that of the window's mean
loss per example, not a mean of microbatch means). Runs in well under a minute on a CPU.

    python examples/quickstart.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import rudax.optim as ro

# ----------------------------------------------------------------------------- config
SEED = 0
IN_FEATURES, HIDDEN, OUT_FEATURES = 16, 64, 4
UPDATES = 300
MICROBATCHES_PER_UPDATE = 4
MAX_MICROBATCH = 48  # each microbatch holds 8..48 examples: unequal on purpose
LEARNING_RATE = 3e-3
LOG_EVERY = 50

# ----------------------------------------------------------------------------- data
# A fixed random "teacher" network; the student learns to imitate it from noisy samples.
rng = np.random.default_rng(SEED)
teacher_w1 = rng.normal(size=(IN_FEATURES, HIDDEN)) / np.sqrt(IN_FEATURES)
teacher_w2 = rng.normal(size=(HIDDEN, OUT_FEATURES)) / np.sqrt(HIDDEN)


def sample_microbatch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Returns x, y padded to MAX_MICROBATCH rows and a mask of the real rows."""
    n = int(rng.integers(8, MAX_MICROBATCH + 1))
    x = rng.normal(size=(MAX_MICROBATCH, IN_FEATURES)).astype(np.float32)
    y = np.tanh(x @ teacher_w1) @ teacher_w2 + 0.01 * rng.normal(size=(MAX_MICROBATCH, 4))
    mask = (np.arange(MAX_MICROBATCH) < n).astype(np.float32)
    return x, y.astype(np.float32), mask


# ----------------------------------------------------------------------------- model
def init_params(key: jax.Array) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    # Stored in bf16: half the memory; the optimizer keeps FP32 masters of these.
    return {
        "w1": (jax.random.normal(k1, (IN_FEATURES, HIDDEN)) / np.sqrt(IN_FEATURES)).astype(
            jnp.bfloat16
        ),
        "b1": jnp.zeros((HIDDEN,), jnp.bfloat16),
        "w2": (jax.random.normal(k2, (HIDDEN, OUT_FEATURES)) / np.sqrt(HIDDEN)).astype(
            jnp.bfloat16
        ),
        "b2": jnp.zeros((OUT_FEATURES,), jnp.bfloat16),
    }


def loss_sum(params, x_BxI, y_BxO, mask_B):
    """Sum over real examples of the squared error; compute in bf16, reduce in fp32."""
    h_BxH = jnp.tanh(x_BxI.astype(jnp.bfloat16) @ params["w1"] + params["b1"])
    pred_BxO = (h_BxH @ params["w2"] + params["b2"]).astype(jnp.float32)
    per_example_B = jnp.sum((pred_BxO - y_BxO) ** 2, axis=-1)
    return jnp.sum(per_example_B * mask_B)


# ----------------------------------------------------------------------------- optimizer
schedule = ro.step_schedule(LEARNING_RATE, step_size=100, gamma=0.5)
tx = ro.fp32_master(optax.chain(ro.clip_by_global_norm(1.0), ro.adamw(schedule)))


# ----------------------------------------------------------------------------- step
@jax.jit
def accumulate(params, acc, x, y, mask):
    loss, grads = jax.value_and_grad(loss_sum)(params, x, y, mask)
    # weight = this microbatch's example count: pop(normalize=True) divides by the total.
    return acc.add(grads, weight=jnp.sum(mask)), loss


@jax.jit
def apply(params, opt_state, acc):
    grads, acc = acc.pop(normalize=True)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, acc


# ----------------------------------------------------------------------------- loop
params = init_params(jax.random.key(SEED))
opt_state = tx.init(params)
acc = ro.GradientAccumulator.init(params, dtype=jnp.float32)  # fp32 sums of bf16 grads

start = time.perf_counter()
first_loss = None
for update in range(1, UPDATES + 1):
    window_loss, window_examples = 0.0, 0.0
    for _ in range(MICROBATCHES_PER_UPDATE):
        x, y, mask = sample_microbatch(rng)
        acc, loss = accumulate(params, acc, x, y, mask)
        window_loss += float(loss)
        window_examples += float(mask.sum())
    params, opt_state, acc = apply(params, opt_state, acc)
    mean_loss = window_loss / window_examples
    first_loss = mean_loss if first_loss is None else first_loss
    if update % LOG_EVERY == 0 or update == 1:
        print(f"update {update:4d}  loss {mean_loss:.5f}  lr {float(schedule(update - 1)):.2e}")

elapsed = time.perf_counter() - start
print(f"done: {UPDATES} updates in {elapsed:.1f}s, loss {first_loss:.4f} -> {mean_loss:.4f}")
if not mean_loss < 0.5 * first_loss:
    raise SystemExit("the loss did not fall: something is wrong")
