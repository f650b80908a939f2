"""rudax.kernels.nf4_matmul: the XLA path is its definition, the Pallas kernels agree with it.

References: ``rows_matmul`` of ``nf4_dequantize``'s weight (the definition, bit for bit), and a
float64 numpy product of a weight dequantized in numpy from the ``NF4Tensor``'s own fields.

The Pallas kernels run in interpret mode on the CPU, where each shape compiles for seconds,
so the cases are few and tiny, with 16-wide tiles: M = 5 and N = 40 end in partial tiles, K =
96 with 64-blocks makes blocks straddle rows of W, block_k = 128 over K = 192 ends in a
partial K step and reads one absmax per weight, block_k = 64 reads one per row.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rudax.kernels as rk
from rudax.kernels import _nf4, _nf4_matmul
from rudax.layers._matmul import rows_matmul
from tests.kernels._lowering import assert_lowers_for_gpu, export, gpu_calls

ON_GPU = jax.default_backend() == "gpu"
# Compiled on a GPU (benchmarks/gpu_check.sh), interpreted elsewhere.
INTERPRET = not ON_GPU
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
# Unit roundoff of each compute dtype (half an ulp at 1): 24, 8 and 11 significand bits.
UNIT_ROUNDOFF = {jnp.float32: 2.0**-24, jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11}


NP_DTYPES = {jnp.float32: np.float32, jnp.bfloat16: ml_dtypes.bfloat16, jnp.float16: np.float16}


@pytest.fixture(autouse=True)
def _float32_dots():
    """fp32 dots in true fp32 on a GPU too, where JAX's default is TF32 (in both paths, the
    kernel's dot following jax_default_matmul_precision as XLA's does): the error bounds below
    assume fp32 products. No effect on the CPU, and none on bf16 or fp16 operands."""
    with jax.default_matmul_precision("highest"):
        yield


@functools.cache
def _weight_and_q(n, k, *, block_size=64, double_quant=True, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(0.0, 0.02, (n, k)).astype(np.float32)
    w.reshape(-1)[rng.integers(0, w.size, 4)] *= 20.0  # outliers, as real weights have
    return rk.nf4_quantize(
        jnp.asarray(w.astype(ml_dtypes.bfloat16)), block_size=block_size, double_quant=double_quant
    )


def _np_x(shape, dtype, seed=1):
    """N(0, 1) values in dtype, as numpy (built without JAX: no compilation per shape)."""
    return np.random.default_rng(seed).normal(size=shape).astype(NP_DTYPES[dtype])


def _x(shape, dtype, seed=1):
    return jnp.asarray(_np_x(shape, dtype, seed))


def _bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


# --- a numpy reference ---------------------------------------------------------------------


def _np_dequantize(q, dtype):
    """W from q's fields in numpy: NF4[code] * absmax in fp32, rounded once to dtype."""
    codes = np.asarray(q.codes)
    index = np.stack([codes >> 4, codes & 0xF], axis=1).reshape(-1, q.block_size)
    if q.absmax is not None:
        absmax = np.asarray(q.absmax)
    else:
        n = q.absmax_codes.shape[0]
        scales = np.repeat(np.asarray(q.absmax_scales), _nf4.ABSMAX_BLOCK_SIZE)[:n]
        # Two fp32 roundings, a product then a sum (numpy fp32 arithmetic rounds each).
        product = _nf4.DYNAMIC_CODE[np.asarray(q.absmax_codes)] * scales
        absmax = product + np.asarray(q.absmax_offset)
    assert absmax.dtype == np.float32
    w = (_nf4.NF4_CODE[index] * absmax[:, None]).astype(np.float32)
    return w.astype(NP_DTYPES[dtype]).reshape(q.shape)


def _np_matmul_and_bound(a, w, dtype, contract_w_axis):
    """a @ w (over w's ``contract_w_axis``) in float64, and how far a c-valued result may be.

    A dot of exact c-valued operands accumulated in fp32 is within ``gamma_K * S`` of the exact
    sum (``S = sum |a_k| |w_k|``, ``gamma_K ~= K * 2**-24``: Higham, Accuracy and Stability,
    3.1; for bf16 and fp16 operands every product is exact in fp32, so it is looser than
    needed), and rounding to c adds ``u_c`` of the value.
    """
    a64 = np.asarray(a, np.float64)
    a64 = a64.reshape(-1, a64.shape[-1])
    w64 = np.asarray(w, np.float64)
    if contract_w_axis == 1:
        w64 = w64.T
    exact = a64 @ w64
    k = a64.shape[1]
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    accumulated = gamma * (np.abs(a64) @ np.abs(w64))
    bound = accumulated + UNIT_ROUNDOFF[dtype] * (np.abs(exact) + accumulated)
    return exact, bound


def _assert_within(got, exact, bound, what):
    got64 = np.asarray(got, np.float64).reshape(exact.shape)
    err = np.abs(got64 - exact)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), (
        f"{what}: |error| {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    )


@functools.partial(jax.jit, static_argnums=(0,))
def _value_and_dx(op, x, dy):
    y, vjp = jax.vjp(op, x)
    return y, vjp(dy)[0]


# --- the XLA path: the definition ----------------------------------------------------------


@pytest.mark.parametrize(
    ("x_dtype", "dtype", "double_quant"),
    [("fp32", None, False), ("bf16", None, True), ("fp16", None, True), ("fp32", "bf16", False)],
)
def test_xla_path_is_dequantize_then_dot(x_dtype, dtype, double_quant):
    q = _weight_and_q(40, 96, double_quant=double_quant)
    x = _x((2, 3, 96), DTYPES[x_dtype])
    c = DTYPES[dtype or x_dtype]
    y = rk.nf4_matmul(x, q, dtype=dtype and c, impl="xla")
    w = rk.nf4_dequantize(q, c)
    want = rows_matmul(x.astype(c), w, w_axis=1)
    assert y.shape == (2, 3, 40) and y.dtype == c
    np.testing.assert_array_equal(_bits(y), _bits(want))
    np.testing.assert_array_equal(_bits(y), _bits(rk.nf4_matmul_reference(x, q, dtype=dtype and c)))

    # Its gradient is autodiff's of the definition, bit for bit, in x's dtype.
    dy = _x((2, 3, 40), c, seed=2)
    _, dx = _value_and_dx(lambda x: rk.nf4_matmul(x, q, dtype=dtype and c, impl="xla"), x, dy)
    _, want_dx = jax.vjp(lambda x: rows_matmul(x.astype(c), w, w_axis=1), x)
    assert dx.dtype == x.dtype
    np.testing.assert_array_equal(_bits(dx), _bits(want_dx(dy)[0]))


@pytest.mark.parametrize(
    ("dtype", "double_quant"),
    [("fp32", False), ("fp32", True), ("bf16", True), ("fp16", False)],
    ids=["fp32-absmax", "fp32-double_quant", "bf16-double_quant", "fp16-absmax"],
)
def test_xla_path_against_float64_numpy(dtype, double_quant):
    c = DTYPES[dtype]
    q = _weight_and_q(40, 96, double_quant=double_quant)
    w_np = _np_dequantize(q, c)
    np.testing.assert_array_equal(_bits(w_np), _bits(rk.nf4_dequantize(q, c)))
    x, dy = _x((7, 96), c), _x((7, 40), c, seed=2)
    y, dx = _value_and_dx(lambda x: rk.nf4_matmul(x, q, impl="xla"), x, dy)
    _assert_within(y, *_np_matmul_and_bound(x, w_np, c, 1), "y")
    _assert_within(dx, *_np_matmul_and_bound(dy, w_np, c, 0), "dx")


# --- the Pallas kernels --------------------------------------------------------------------

# (x's dtype, the compute dtype, W [N, K], block_size, double_quant, tiles m, n, k, x 3-D)
PALLAS_CASES = [
    pytest.param("fp32", None, (40, 192), 64, False, (16, 16, 64), False, id="fp32-row-absmax"),
    pytest.param("bf16", None, (40, 192), 64, True, (16, 16, 128), True, id="bf16-k-tail-3d"),
    pytest.param("fp16", None, (40, 96), 64, True, (16, 16, 64), False, id="fp16-straddling"),
    pytest.param("fp32", "bf16", (48, 96), 32, False, (16, 32, 32), False, id="fp32-as-bf16"),
]


@pytest.mark.parametrize(
    ("x_dtype", "dtype", "w_shape", "block_size", "double_quant", "tiles", "three_d"),
    PALLAS_CASES,
)
def test_pallas_matches_xla_and_float64(
    x_dtype, dtype, w_shape, block_size, double_quant, tiles, three_d
):
    """Forward and dx of the kernels, on rows of three kinds (one compilation per case):

    - 5 random rows, checked against the float64 product within the bound of fp32
      accumulation (``_np_matmul_and_bound``), and against the XLA path and jax.grad of the
      reference within twice that (the same products summed in another order);
    - one-hot rows: x = I_K gives y = W^T and dy = I_N gives dx = W, each output one product
      w * 1 plus zeros, exact in fp32 and in c, so the tiles the kernels dequantize must be
      nf4_dequantize's bit for bit (a swapped nibble, another absmax or rounding shows);
    - zero rows up to an even M that no tile divides.
    """
    (n, k), x_dtype = w_shape, DTYPES[x_dtype]
    c = DTYPES[dtype] if dtype else x_dtype
    q = _weight_and_q(n, k, block_size=block_size, double_quant=double_quant)
    m = 5 + max(n, k) + (1 + max(n, k)) % 2
    x, dy = np.zeros((m, k), NP_DTYPES[x_dtype]), np.zeros((m, n), NP_DTYPES[c])
    x[:5], x[5 : 5 + k] = _np_x((5, k), x_dtype), np.eye(k)
    dy[:5], dy[5 : 5 + n] = _np_x((5, n), c, seed=2), np.eye(n)
    if three_d:
        x, dy = x.reshape(2, m // 2, k), dy.reshape(2, m // 2, n)
    kw = dict(dtype=dtype and c)
    block = rk.NF4MatmulBlock(*tiles)
    pallas = lambda x: rk.nf4_matmul(x, q, impl="pallas", interpret=INTERPRET, block=block, **kw)
    y, dx = _value_and_dx(pallas, x, dy)
    assert y.shape == dy.shape and y.dtype == c and dx.shape == x.shape and dx.dtype == x_dtype
    y, dx = np.asarray(y).reshape(m, n), np.asarray(dx).reshape(m, k).astype(NP_DTYPES[c])

    w = np.asarray(rk.nf4_dequantize(q, c))
    np.testing.assert_array_equal(_bits(y[5 : 5 + k]), _bits(w.T), err_msg="y of I_K")
    np.testing.assert_array_equal(_bits(dx[5 : 5 + n]), _bits(w), err_msg="dx of I_N")

    w_np = _np_dequantize(q, c)
    y64, y_bound = _np_matmul_and_bound(x.astype(NP_DTYPES[c]), w_np, c, 1)
    dx64, dx_bound = _np_matmul_and_bound(dy, w_np, c, 0)
    _assert_within(y, y64, y_bound, "pallas y vs float64")
    _assert_within(dx, dx64, dx_bound, "pallas dx vs float64")
    y_xla, dx_xla = _value_and_dx(lambda x: rk.nf4_matmul(x, q, impl="xla", **kw), x, dy)
    _, dx_ref = _value_and_dx(lambda x: rk.nf4_matmul_reference(x, q, **kw), x, dy)
    as64 = lambda a, like: np.asarray(a, np.float64).reshape(like.shape)
    _assert_within(y, as64(y_xla, y64), 2 * y_bound, "y vs xla")
    _assert_within(dx, as64(dx_xla, dx64), 2 * dx_bound, "dx vs xla")
    _assert_within(dx, as64(dx_ref, dx64), 2 * dx_bound, "dx vs jax.grad(reference)")


@pytest.mark.parametrize(
    ("x_shape", "dtype", "w_shape"),
    [((64, 4096), jnp.bfloat16, (4096, 4096)), ((3, 5, 160), jnp.float16, (36, 160))],
    ids=["64x4096-bf16-W4096x4096", "3x5x160-fp16-W36x160"],
)
def test_lowers_for_gpu(x_shape, dtype, w_shape):
    """A real projection, and an awkward one (3-D x, 64-blocks straddling rows, N = 36)."""
    q = jax.eval_shape(rk.nf4_quantize, jax.ShapeDtypeStruct(w_shape, jnp.bfloat16))
    leaves, treedef = jax.tree.flatten(q)
    assert_lowers_for_gpu(
        lambda x, *leaves: rk.nf4_matmul(x, jax.tree.unflatten(treedef, leaves), impl="pallas"),
        jax.ShapeDtypeStruct(x_shape, dtype),
        *leaves,
        kernels=["nf4_matmul_fwd"],
        backward_kernels=["nf4_matmul_bwd"],
    )


# --- jit, shard_map, gradients of q --------------------------------------------------------


def test_second_call_does_not_recompile():
    q = _weight_and_q(40, 96)
    shape = (9, 96)  # a shape no other test uses, so the first call below compiles
    op = lambda x: rk.nf4_matmul(x, q, impl="pallas", interpret=INTERPRET)
    before = _nf4_matmul._nf4_matmul_jit._cache_size()
    op(_x(shape, jnp.bfloat16, seed=3))
    assert _nf4_matmul._nf4_matmul_jit._cache_size() == before + 1
    op(_x(shape, jnp.bfloat16, seed=4))
    q2 = _weight_and_q(40, 96, seed=5)  # another weight of the same shape: no new trace
    rk.nf4_matmul(_x(shape, jnp.bfloat16, seed=4), q2, impl="pallas", interpret=INTERPRET)
    assert _nf4_matmul._nf4_matmul_jit._cache_size() == before + 1, "the second call recompiled"


def test_weight_gets_a_zero_cotangent():
    q = _weight_and_q(40, 96)
    x = _x((3, 96), jnp.float32)
    grad_q = jax.grad(lambda q: rk.nf4_matmul(x, q).sum(), allow_int=True)(q)
    assert isinstance(grad_q, rk.NF4Tensor)
    assert grad_q.codes.dtype == grad_q.absmax_codes.dtype == jax.dtypes.float0
    for leaf in (grad_q.absmax_scales, grad_q.absmax_offset):
        assert leaf.dtype == jnp.float32 and not np.any(np.asarray(leaf))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_backward_saves_only_the_weight(impl, capsys):
    """dx = dy @ W needs no activation: the residuals are q's own arrays (traced only)."""
    q = _weight_and_q(40, 96)
    x = _x((3, 96), jnp.bfloat16)
    kw = dict(impl=impl, interpret=INTERPRET) if impl == "pallas" else dict(impl=impl)
    print_saved_residuals(lambda x, q: rk.nf4_matmul(x, q, **kw).astype(jnp.float32).sum(), x, q)
    lines = capsys.readouterr().out.strip().splitlines()
    assert sorted(lines) == [
        "f32[1] from the argument q.absmax_scales",
        "f32[] from the argument q.absmax_offset",
        "u8[1920] from the argument q.codes",
        "u8[60] from the argument q.absmax_codes",
    ], lines


def test_autodiff_of_the_reference_would_fail_the_residual_check(capsys):
    """The check above can fail: plain autodiff keeps x and the dequantized weight."""
    q = _weight_and_q(40, 96)
    x = _x((3, 96), jnp.bfloat16)
    loss = lambda x, q: rk.nf4_matmul_reference(x, q).astype(jnp.float32).sum()
    print_saved_residuals(loss, x, q)
    out = capsys.readouterr().out
    assert "bf16[3,96] from the argument x" in out and "bf16[40,96]" in out


INTERPRETER_VMA = pytest.mark.xfail(
    INTERPRET,
    reason="jax 0.10.2 and 0.11.2 Pallas interpreter under shard_map(check_vma=True): "
    "'Primitive gather requires varying manual axes to match' (as in "
    "tests/kernels/test_shard_map.py)",
    raises=ValueError,
    strict=True,
)


@pytest.mark.parametrize(
    ("kwargs", "check_vma"),
    [
        pytest.param({"impl": "xla"}, True, id="xla"),
        pytest.param(
            {"impl": "pallas", "interpret": INTERPRET}, True, id="pallas", marks=INTERPRETER_VMA
        ),
        # Without the manual-axis type check the interpreter runs the kernels per rank.
        pytest.param({"impl": "pallas", "interpret": INTERPRET}, False, id="pallas-no-vma"),
    ],
)
def test_shard_map_rows_equal_one_device(kwargs, check_vma):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    q = _weight_and_q(40, 96)
    x = _x((2 * mesh.size, 96), jnp.float32)

    def value_and_grad(x, q):
        return jax.value_and_grad(lambda x: jnp.sum(rk.nf4_matmul(x, q, **kwargs) ** 2))(x)

    def per_rank(x, q):
        loss, dx = value_and_grad(x, q)
        return jax.lax.psum(loss, "data"), dx

    sharded = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(P("data"), P()),
        out_specs=(P(), P("data")),
        check_vma=check_vma,
    )
    loss, dx = jax.jit(sharded)(jax.device_put(x, NamedSharding(mesh, P("data"))), q)
    want_loss, want_dx = jax.jit(value_and_grad)(x, q)
    # Each rank's rows are the one-device rows, the same dot per row: equal up to the sum of
    # the per-rank losses (another order of the same fp32 terms).
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(want_dx))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)


# --- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "q", "kwargs", "error", "match"),
    [
        (jnp.ones((3, 95)), "q", {}, ValueError, r"x.shape\[-1\] must equal q.shape\[1\] \(K = 96"),
        (jnp.ones(()), "q", {}, ValueError, r"x.shape=\(\)"),
        (jnp.ones((3, 96)), jnp.ones((40, 96)), {}, TypeError, "q must be an NF4Tensor.*ArrayImpl"),
        (jnp.ones((3, 96), jnp.int32), "q", {}, TypeError, "x must be a floating.*x.dtype=int32"),
        ([1.0] * 96, "q", {}, TypeError, "x must be a floating.*got list"),
        (jnp.ones((3, 96)), "q", {"dtype": jnp.int8}, TypeError, "dtype must be a floating dtype"),
        (jnp.ones((3, 96)), "q", {"impl": "triton"}, ValueError, "impl='triton'"),
        (jnp.ones((3, 96)), "q", {"block": 64}, TypeError, "block=64"),
        (jnp.ones((3, 96)), "q", {"interpret": 1}, TypeError, "interpret=1"),
        (jnp.ones((3, 96)), "q3d", {}, ValueError, r"2-D weight \[N, K\].*q.shape=\(2, 20, 96\)"),
    ],
)
def test_bad_inputs(x, q, kwargs, error, match):
    if q == "q":
        q = _weight_and_q(40, 96)
    elif q == "q3d":
        q = rk.nf4_quantize(jnp.ones((2, 20, 96)))
    with pytest.raises(error, match=match):
        rk.nf4_matmul(x, q, **kwargs)


def test_pallas_refuses_what_it_does_not_take():
    q = _weight_and_q(40, 96)
    with jax.enable_x64(True):
        x = jnp.ones((3, 96), jnp.float64)
        with pytest.raises(ValueError, match=r"impl='pallas' computes in float32.*dtype=float64"):
            rk.nf4_matmul(x, q, impl="pallas", interpret=True)
        # "auto" takes the XLA path for it instead, on every platform.
        jaxpr = str(jax.make_jaxpr(lambda x: rk.nf4_matmul(x, q))(x))
        assert "rudax_on_platform" not in jaxpr and "f64[3,40]" in jaxpr
    if not ON_GPU:
        with pytest.raises(ValueError, match="interpret=True"):
            rk.nf4_matmul(jnp.ones((3, 96)), q, impl="pallas")


def test_auto_takes_xla_on_every_platform_and_pallas_is_asked_for():
    """The "auto" path is XLA, also for CUDA (3.4x faster than the kernels on an H200);
    impl="pallas" exports the forward and backward kernels for CUDA."""
    q = _weight_and_q(40, 96)
    x = jax.ShapeDtypeStruct((3, 96), jnp.bfloat16)
    assert "rudax_on_platform" not in str(jax.make_jaxpr(lambda x: rk.nf4_matmul(x, q))(x))
    auto = lambda x: rk.nf4_matmul(x, q)
    assert gpu_calls(export(auto, x, platforms=["cuda"]).mlir_module()) == 0

    def pallas(x):
        y, vjp = jax.vjp(lambda x: rk.nf4_matmul(x, q, impl="pallas"), x)
        return y, vjp(jnp.ones_like(y))[0]

    assert gpu_calls(export(pallas, x, platforms=["cuda"]).mlir_module()) == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"block_m": 48}, ValueError, "block_m=48"),
        ({"block_k": 0}, ValueError, "block_k=0"),
        ({"block_n": 64.0}, TypeError, "block_n=64.0"),
        ({"num_warps": 3}, ValueError, "num_warps=3"),
        ({"num_stages": 0}, ValueError, "num_stages=0"),
    ],
)
def test_bad_block(kwargs, error, match):
    with pytest.raises(error, match=match):
        rk.NF4MatmulBlock(**kwargs)
