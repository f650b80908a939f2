"""enable_deterministic_gpu: XLA_FLAGS set before a backend starts, refused after."""

import os
import subprocess
import sys
import textwrap

import pytest

import rudax.kernels as rk


def test_sets_the_flags_in_a_fresh_process_and_refuses_once_jax_started():
    script = textwrap.dedent(
        """
        import os
        import rudax.kernels as rk
        flags = rk.enable_deterministic_gpu()
        assert flags == os.environ["XLA_FLAGS"], flags
        parts = flags.split()
        assert "--xla_force_host_platform_device_count=2" in parts, parts
        assert "--xla_gpu_deterministic_ops=false" not in parts, parts
        assert parts.count("--xla_gpu_deterministic_ops=true") == 1, parts
        import jax
        assert jax.device_count() == 2  # the kept flag took effect, the new ones parse
        try:
            rk.enable_deterministic_gpu()
        except RuntimeError as e:
            assert "must run before JAX initializes a backend" in str(e)
        else:
            raise AssertionError("no RuntimeError once a backend is up")
        print("ok")
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 --xla_gpu_deterministic_ops=false"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_refuses_in_this_process():
    import jax

    jax.devices()  # this test process has a backend
    with pytest.raises(RuntimeError, match=r"XLA_FLAGS="):
        rk.enable_deterministic_gpu()
