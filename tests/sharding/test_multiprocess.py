"""DataParallel across 2 processes x 2 CPU devices on localhost, and the runner that starts them.

Each process is a fresh interpreter joined by ``jax.distributed.initialize`` over gloo; see
``_multiprocess.py``. The reference is computed here, in the test process, on one device.
"""

import os
import re
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.sharding import _dp_worker
from tests.sharding._multiprocess import MultiprocessError, run_processes

HERE = Path(__file__).parent


def _from_json(like, tree):
    """tree, whose leaves are nested lists, as arrays of like's structure and dtypes."""
    return jax.tree.map(lambda w, g: np.asarray(g, w.dtype), like, tree)


def test_data_parallel_two_processes_matches_single_device():
    results = run_processes(HERE / "_dp_worker.py", 2, 2, timeout=60)

    params, x_NxLxD, y_NxL, mask_NxL = _dp_worker.data()
    valid = mask_NxL.reshape(-1) == 1
    x_TxD, y_T = x_NxLxD.reshape(-1, _dp_worker.D)[valid], y_NxL.reshape(-1)[valid]
    assert x_TxD.shape[0] == _dp_worker.COUNTS.sum()
    loss = lambda p: jnp.mean(_dp_worker.token_losses(p, x_TxD, y_T))
    want = jax.tree.map(np.asarray, jax.grad(loss)(params))

    assert [r["process_index"] for r in results] == [0, 1]
    for r in results:
        assert r["process_count"] == 2 and r["local_devices"] == 2
        assert r["promotion"] == "strict"
        # Every replica started different; after initialize all hold root's, bit for bit.
        got_params = _from_json(params, r["params"])
        jax.tree.map(np.testing.assert_array_equal, got_params, params)
        for key in ("grads_invariant", "grads_varying"):
            got = _from_json(want, r[key])
            assert jax.tree.structure(got) == jax.tree.structure(want)
            check = lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
            jax.tree.map(check, got, want)
    # One all-reduced value: the two processes hold exactly the same gradients.
    assert results[0]["grads_invariant"] == results[1]["grads_invariant"]
    assert results[0]["grads_varying"] == results[1]["grads_varying"]


def _worker(tmp_path, body):
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return path


def _dead(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_timeout_kills_hung_processes(tmp_path):
    worker = _worker(
        tmp_path,
        """
        import os, time
        def main():
            print("pid", os.getpid(), flush=True)
            time.sleep(600)
        """,
    )
    start = time.monotonic()
    with pytest.raises(MultiprocessError, match=r"timed out after 5 s; processes \[0, 1\]") as e:
        run_processes(worker, 2, 2, timeout=5)
    assert time.monotonic() - start < 15
    message = str(e.value)
    assert "process 0 (exit -9)" in message and "process 1 (exit -9)" in message
    pids = [int(p) for p in re.findall(r"pid (\d+)", message)]
    assert len(pids) == 2 and all(_dead(p) for p in pids)


def test_one_failed_process_stops_the_others(tmp_path):
    # Process 0 would wait forever for its peer; the runner must not wait for the timeout.
    worker = _worker(
        tmp_path,
        """
        import time, jax
        def main(failing):
            if jax.process_index() == failing:
                raise RuntimeError(f"boom in process {failing}")
            time.sleep(600)
        """,
    )
    start = time.monotonic()
    with pytest.raises(MultiprocessError, match="process 1 exited with status 1") as e:
        run_processes(worker, 2, 1, timeout=60, args=[1])
    assert time.monotonic() - start < 30
    assert "RuntimeError: boom in process 1" in str(e.value)
    assert "process 0 (exit -9)" in str(e.value)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="worker must be a Python file"):
        run_processes(tmp_path / "missing.py")
    worker = _worker(tmp_path, "def main():\n    return 1\n")
    with pytest.raises(ValueError, match="num_processes=0"):
        run_processes(worker, 0)
