"""Test settings shared by the whole suite.

The device count must be fixed before JAX initialises its backends, so it is set here, at
import time of the first conftest, before any test module imports jax.
"""

import atexit
import gc
import os
import shutil
import tempfile

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICE_FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the whole run: pytest-xdist's workers and the
# processes tests start inherit it, so a program compiled once (the trainer's steps, which
# every trainer test builds anew with the same shapes) is read back instead of compiled again.
# That cut tests/lm/test_train.py's CPU time by a third. The cache is made fresh for each
# run and removed by the process that made it; it holds XLA's executables, never results.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="rudax-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
    """Runs every test under strict dtype promotion unless marked ``standard_promotion``.

    Strict promotion turns an accidental bf16 + fp32 mix into an error instead of a silent
    upcast: precision in rudax is explicit, and rudax's own code must run under it. optax's
    own code does not (its schedules multiply a Python float by an int32 count, its moment
    updates mix dtypes), so tests that run optax code mark themselves and say so.
    """
    mode = "standard" if request.node.get_closest_marker("standard_promotion") else "strict"
    with jax.numpy_dtype_promotion(mode):
        yield


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops jax's in-memory caches (compiled programs, traced jaxprs) after each test module.

    A worker runs half the suite in one process; kept, its compiled programs grew each worker
    past 4.6 GB by the middle of the suite, and two workers beside the processes some tests
    start came near the machine's 24 GB. The persistent compilation cache on disk (above)
    still holds the executables, so a program met again is read back, not recompiled.
    """
    yield
    jax.clear_caches()
    gc.collect()


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"


def pytest_collection_modifyitems(config, items):
    """The tests marked ``long(minutes)`` (the README's commands in order, the multi-process
    runs) go first, the longest first. pytest-xdist's worksteal splits the list between the
    workers and lets an idle one take the other's queued tests; a test of minutes collected
    last would start last and keep one worker busy while the other has nothing left."""

    def minutes(item):
        mark = item.get_closest_marker("long")
        return 0.0 if mark is None else float(mark.args[0])

    items.sort(key=minutes, reverse=True)  # stable: the others keep their order
