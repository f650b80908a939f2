"""benchmarks/attention: the claims its tables rest on, checked at small sizes on the CPU.

* flash attention's forward + backward needs O(T) temporary memory (XLA's own accounting),
  the blocked attention it replaced O(T^2);
* its program does not grow with T (``lax`` loops, no Python loop over blocks): the lowered
  HLO has the same number of lines at T = 256 and T = 4096;
* the time table's modes run and give every arm.
"""

import jax
import jax.numpy as jnp
import pytest

import rudax.kernels as rk
from benchmarks import attention


def _temp_mb(name: str, t: int) -> float:
    args = attention._inputs(1, t, 2, 2, 32, jnp.float32)
    fn = attention.attention_fns()[name]
    temp, _ = attention._temp_bytes(attention._forward_backward(fn), *args)
    return temp / 2**20


def test_flash_attention_memory_grows_linearly_and_blocked_quadratically():
    flash = [_temp_mb("flash", t) for t in (512, 1024, 2048)]
    blocked = [_temp_mb("blocked", t) for t in (512, 1024)]
    # Doubling T doubles the kernel's inputs, outputs and fp32 dQ buffer (plus a constant
    # chunk of scores): at most ~2x. The blocked attention's scores grow 4x.
    assert flash[1] / flash[0] < 2.2 and flash[2] / flash[1] < 2.2, flash
    assert blocked[1] / blocked[0] > 3.0, blocked
    assert flash[1] < blocked[1] / 4, (flash, blocked)


def test_flash_attention_program_does_not_grow_with_t():
    def hlo_lines(t):
        s = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)

        def step(q, k, v):
            out, vjp = jax.vjp(lambda q, k, v: rk.flash_attention(q, k, v, causal=True), q, k, v)
            return vjp(out)

        return len(jax.jit(step).lower(s, s, s).as_text().splitlines())

    assert hlo_lines(256) == hlo_lines(4096)


def test_time_table_runs_every_arm():
    rows = attention.time_table([(1, 64, 2, 1, 16)], jnp.float32, rounds=1, iters=1)
    arms = {(r["kind"], r["arm"]) for r in rows}
    assert arms == {
        (kind, arm)
        for kind in ("fwd", "fwd+bwd")
        for arm in ("flash", "blocked", "dot_product_attention")
    }
    assert all(r["ms"] > 0 and r["temp_mb"] >= 0 for r in rows)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="Pallas vs cuDNN needs a GPU")
def test_gpu_table_runs_on_a_gpu():
    rows = attention.gpu_table(1, 256, 4, 64, 4, rounds=1, iters=1)
    assert {r["arm"] for r in rows} == {"pallas", "cudnn", "cudnn+mask"}
