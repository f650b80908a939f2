"""flash_attention at the edges a review found: x64 mode, windows past int32, odd dtypes, and
what impl="cudnn" refuses. Each test failed on the code before its fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rudax.kernels as rk
from tests.kernels._lowering import assert_lowers_for_gpu

INTERPRET = jax.default_backend() != "gpu"


def _qkv(dtype=jnp.float32, t=20, h=4, g=2, k=16):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, t, h, k), jnp.float32).astype(dtype)
    kv = [jax.random.normal(x, (1, t, g, k), jnp.float32).astype(dtype) for x in keys[1:]]
    return q, *kv


def test_the_pallas_path_runs_under_x64():
    """The kernels' head -> kv-head index was an int32 program id divided by a Python int,
    which x64 makes int64: lax.div refused the mix."""
    with jax.enable_x64(True):
        q, k, v = _qkv()
        block = rk.FlashAttentionBlock(q=16, kv=16, q_backward=16, kv_backward=16)
        f = lambda q, k, v: rk.flash_attention(
            q, k, v, causal=True, impl="pallas", interpret=INTERPRET, block=block
        )
        out, vjp = jax.vjp(f, q, k, v)
        grads = vjp(out)
        ref, ref_vjp = jax.vjp(lambda *a: rk.flash_attention_reference(*a, causal=True), q, k, v)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
        for got, want in zip(grads, ref_vjp(out), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        s = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
        assert_lowers_for_gpu(
            lambda q, k, v: rk.flash_attention(q, k, v, causal=True, impl="pallas"),
            s,
            kv,
            kv,
            kernels=["flash_attention_fwd"],
            backward_kernels=["flash_attention_dkdv", "flash_attention_dq"],
        )


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_window_wider_than_the_sequence_is_no_window(impl, causal):
    """Positions plus a window side near 2**31 overflowed int32 and hid visible keys."""
    q, k, v = _qkv()
    kw = dict(impl=impl, interpret=INTERPRET) if impl == "pallas" else dict(impl=impl)
    full = rk.flash_attention(q, k, v, causal=causal, **kw)
    for window in [(2**31 - 8, 2**31 - 8), (2**31 - 1, 2**31 - 1), (2**40, 2**40)]:
        if causal:
            window = (window[0], 0)
        wide = rk.flash_attention(q, k, v, causal=causal, window=window, **kw)
        np.testing.assert_array_equal(wide, full)
        ref = rk.flash_attention_reference(q, k, v, causal=causal, window=window)
        np.testing.assert_allclose(ref, full, rtol=1e-5, atol=1e-6)


def test_fp8_is_refused():
    q, k, v = _qkv(jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="float16, bfloat16, float32"):
        rk.flash_attention(q, k, v)


def test_the_reference_checks_scale_and_softcap():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale"):
        rk.flash_attention_reference(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        rk.flash_attention_reference(q, k, v, softcap=0.0)


@pytest.mark.parametrize(
    "options",
    [dict(window=(4, 0)), dict(window=(4, 2), causal=True), dict(window=(0, 3))],
    ids=["bidirectional-left", "causal-right", "right"],
)
def test_cudnn_refuses_windows_it_would_compute_differently(options):
    q, k, v = _qkv(jnp.bfloat16)
    with pytest.raises(ValueError, match="impl='cudnn' cannot compute this attention: a window"):
        rk.flash_attention(q, k, v, impl="cudnn", **options)
