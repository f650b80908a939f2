"""FSDP across 2 processes x 2 CPU devices on localhost: the tiny transformer trains as on one.

Each process is a fresh interpreter joined by ``jax.distributed.initialize`` over gloo (see
``_multiprocess.py``) and runs ``_fsdp_worker.py``. The reference is computed here, in the test
process, on one device: the same modules, seeds, batch, loss and optimizer.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tests.sharding import _fsdp_worker as worker
from tests.sharding import test_fsdp as tf
from tests.sharding._multiprocess import run_processes

HERE = Path(__file__).parent


def _reference():
    """Losses and final parameters {"name/path": value} of the run on one device."""
    model = nnx.Dict(tf._transformer(lora=False))
    graph, params = nnx.split(model, nnx.Param)
    ids = worker.batch()
    total = ids.shape[0] * tf.T
    tx = worker.make_tx()

    def loss_fn(p):
        logits = tf._forward(nnx.merge(graph, p), ids[:, :-1])
        logp = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        return -jnp.sum(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)) / total

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state, losses = tx.init(params), []
    for _ in range(worker.STEPS):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    nnx.update(model, params)
    flat = nnx.to_flat_state(nnx.state(model))
    return losses, {"/".join(str(k) for k in path): np.asarray(v.get_value()) for path, v in flat}


def test_fsdp_two_processes_matches_single_device():
    results = run_processes(HERE / "_fsdp_worker.py", 2, 2, timeout=60)
    want_losses, want_params = _reference()

    assert [r["process_index"] for r in results] == [0, 1]
    assert [r["ranks"] for r in results] == [[0, 1], [2, 3]]
    for r in results:
        # from_local asked each process only for its own ranks' slices, for every parameter.
        assert r["from_local_ranks"] == [r["ranks"]]
        assert r["compilations"] == 1
        np.testing.assert_allclose(r["losses"], want_losses, rtol=1e-5)
        # The tied head has no variable of its own: both sides hold the embedding once.
        assert r["params"].keys() >= want_params.keys()
        for path, want in want_params.items():
            got = np.asarray(r["params"][path], want.dtype)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=path)
    # The same global arrays, gathered: both processes report identical values.
    assert results[0]["losses"] == results[1]["losses"]
    assert results[0]["params"] == results[1]["params"]
