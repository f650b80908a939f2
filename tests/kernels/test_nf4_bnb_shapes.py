"""NF4 double quantization against bitsandbytes, bit for bit, over many real and odd shapes.

The offset that double quantization subtracts is torch's ``absmax.mean()``, whose last bit
depends on torch's summation order; rudax reproduces that order (``_torch_sum.py``). Each case
compares everything bitsandbytes stores (4-bit codes, 8-bit absmax codes, their fp32 scales,
the offset) and the dequantized weight, bitwise, in fp32, bf16 and fp16: the projection shapes
of SmolLM-135M and Llama 3 8B (one layer of each, as torch ``[out, in]``), 1-block weights,
odd block counts, and block counts on each boundary of torch's cascade sum (the odd shapes in
bf16 and fp16 under ``-m slow``: their block counts are those of their fp32 case).

bitsandbytes runs with one torch thread here: from 32,768 blocks on, torch splits the sum
between its threads and its last bit then depends on their number. rudax follows one thread;
``test_torch_sum_follows_torch_threads`` checks the split itself.
"""

import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rudax.kernels import nf4_dequantize, nf4_quantize
from rudax.kernels._torch_sum import GRAIN_SIZE, torch_cpu_mean, torch_cpu_sum
from tests._bitsandbytes import bnbf, dequantize_4bit, needs_bitsandbytes

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason="rudax follows torch's x86 sum (8 fp32 lanes); on aarch64 torch sums in 4",
)

DTYPES = {
    "float32": (jnp.float32, torch.float32),
    "bfloat16": (jnp.bfloat16, torch.bfloat16),
    "float16": (jnp.float16, torch.float16),
}

# Each distinct projection shape of one decoder layer, as torch's [out, in].
SMOLLM_135M = {  # hidden 576, 9 heads and 3 kv heads of 64, intermediate 1536
    "q_o_proj": (576, 576),
    "k_v_proj": (192, 576),
    "gate_up_proj": (1536, 576),
    "down_proj": (576, 1536),
}
LLAMA3_8B = {  # hidden 4096, 32 heads and 8 kv heads of 128, intermediate 14336
    "q_o_proj": (4096, 4096),
    "k_v_proj": (1024, 4096),
    "gate_up_proj": (14336, 4096),
    "down_proj": (4096, 14336),
}

# Block counts (n = size / 64) chosen for torch's sum, which reads n as n // 8 SIMD vectors of
# 8 lanes, 4 vectors a row, in runs of 16 rows, 16 runs, 16 runs of runs: 1 block; fewer than
# 8 (no vector); 8k +- 1; fewer than 4 vectors (no row: n < 32); 16 rows (n = 512), 256 rows
# (n = 8192) and those +- 1; odd counts; a last 256-block of the 8-bit absmax holding 1 value.
ODD_SHAPES = [
    (1, 64),
    (64, 1),
    (8, 8),
    (2, 3, 32),
    (3, 64),
    (5, 64),
    (7, 128),
    (9, 64),
    (15, 64),
    (17, 64),
    (31, 64),
    (33, 64),
    (63, 128),
    (65, 64),
    (127, 64),
    (129, 64),
    (255, 64),
    (257, 64),
    (511, 64),
    (512, 64),
    (513, 64),
    (1025, 64),
    (33, 4032),
    (8191, 64),
    (8192, 64),
    (8193, 64),
    (4160,),
    (3, 7, 192),
    (11, 11, 64),
    (97, 320),
    (127, 576),
    (191, 1536),
    (333, 192),
    (700, 448),
    (999, 640),
    (1000, 2112),
    (2047, 576),
    (4095, 448),
    (2, 4096),
    (3, 14336),
    (4097, 64),
    (1, 131072),
    (45, 4160),
]
# Each 8B projection with fewer rows (the columns, which set how a row's 64-blocks fall, kept):
# the same kinds of block counts, under 32,768 blocks, fast enough for every run.
LLAMA3_8B_FEW_ROWS = [(512, 4096), (128, 4096), (96, 14336), (20, 14336)]


def _id(shape):
    return "x".join(map(str, shape))


# (shape, seed): each SmolLM shape under three seeds, the others under one of their own.
CASES = [
    *(
        pytest.param(shape, seed, id=f"smollm-{name}-seed{seed}")
        for name, shape in SMOLLM_135M.items()
        for seed in range(3)
    ),
    *(pytest.param(shape, 100 + i, id=_id(shape)) for i, shape in enumerate(ODD_SHAPES)),
    *(
        pytest.param(shape, 200 + i, id=f"llama3-8b-rows-{_id(shape)}")
        for i, shape in enumerate(LLAMA3_8B_FEW_ROWS)
    ),
    # 17M to 59M weights but k/v's 4M: quantizing in both libraries takes 1.5-8 s per case.
    *(
        pytest.param(
            shape,
            300 + i,
            id=f"llama3-8b-{name}",
            marks=() if name == "k_v_proj" else pytest.mark.slow,
        )
        for i, (name, shape) in enumerate(LLAMA3_8B.items())
    ),
]


@pytest.fixture
def one_torch_thread():
    """torch on one thread: its sum's order then does not depend on the machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _weight(shape, dtype_name, seed):
    """A weight in both frameworks with the same bits: rows of different scales, outliers."""
    jdtype, tdtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape, dtype=np.float32)
    rows = w.reshape(shape[0], -1) if len(shape) > 1 else w.reshape(1, -1)
    rows *= np.float32(0.02) * np.exp(rng.normal(0.0, 0.5, (rows.shape[0], 1))).astype(np.float32)
    w.reshape(-1)[rng.integers(0, w.size, 8)] *= np.float32(30.0)
    w_t = torch.from_numpy(w).to(tdtype)
    w_j = jnp.asarray(w_t.float().numpy()).astype(jdtype)
    return w_j, w_t


def _bits(x):
    """An array's bits, for bitwise comparison (NaN-safe, -0.0 != 0.0)."""
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def _torch_bits(t):
    """A torch tensor's bits (NumPy has no bfloat16)."""
    size = t.element_size()
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[size]).numpy().view(f"u{size}")


def _with_dtypes(cases):
    """Each case in each dtype; an odd shape's bf16 and fp16 cases are slow: the block counts
    they test are its fp32 case's, and the real models' shapes run in every dtype in CI."""
    for case in cases:
        (shape, seed), odd = case.values, not case.id.startswith(("smollm", "llama3"))
        for name in DTYPES:
            marks = [*case.marks, *([pytest.mark.slow] if odd and name != "float32" else [])]
            yield pytest.param(shape, seed, name, id=f"{case.id}-{name}", marks=marks)


@needs_bitsandbytes
@pytest.mark.parametrize(("shape", "seed", "dtype_name"), _with_dtypes(CASES))
def test_double_quant_is_bitsandbytes_bitwise(shape, seed, dtype_name, one_torch_thread):
    w_j, w_t = _weight(shape, dtype_name, seed)
    codes_t, state = bnbf.quantize_4bit(
        w_t, quant_type="nf4", blocksize=64, compress_statistics=True
    )
    want = dequantize_4bit(codes_t, state)

    q = nf4_quantize(w_j, absmax_rounding="cpu")
    np.testing.assert_array_equal(np.asarray(q.codes), codes_t.numpy().reshape(-1))
    assert _bits(q.absmax_offset) == _bits(state.offset.numpy()), (
        f"offset {float(q.absmax_offset)!r} != bitsandbytes' {state.offset.item()!r}"
    )
    np.testing.assert_array_equal(_bits(q.absmax_scales), _bits(state.state2.absmax.numpy()))
    np.testing.assert_array_equal(np.asarray(q.absmax_codes), state.absmax.numpy())
    out = nf4_dequantize(q)
    assert out.dtype == w_j.dtype and out.shape == tuple(shape)
    np.testing.assert_array_equal(_bits(out), _torch_bits(want))


@needs_bitsandbytes
@pytest.mark.parametrize("name", list(SMOLLM_135M))
def test_cuda_rounding_shares_the_offset_and_scales(name, one_torch_thread):
    """absmax_rounding="cuda" rounds some 8-bit codes differently, never the offset or scales."""
    w_j, w_t = _weight(SMOLLM_135M[name], "bfloat16", 7)
    _, state = bnbf.quantize_4bit(w_t, quant_type="nf4", blocksize=64, compress_statistics=True)
    q = nf4_quantize(w_j, absmax_rounding="cuda")
    assert _bits(q.absmax_offset) == _bits(state.offset.numpy())
    np.testing.assert_array_equal(_bits(q.absmax_scales), _bits(state.state2.absmax.numpy()))
    differ = np.asarray(q.absmax_codes) != state.absmax.numpy()
    assert differ.mean() < 0.01


@pytest.mark.parametrize("shape", [(3, 64), (576, 576), (513, 4096)], ids=_id)
def test_quantize_under_jit_is_the_eager_result(shape):
    """Traced, the offset is summed by jnp instead of NumPy: the same additions, same bits
    (the 2.1M-weight case has 32,832 blocks, past torch's grain size)."""
    w_j, _ = _weight(shape, "bfloat16", 17)
    eager = nf4_quantize(w_j, absmax_rounding="cpu")
    traced = jax.jit(lambda w: nf4_quantize(w, absmax_rounding="cpu"))(w_j)
    for name in ("codes", "absmax_codes", "absmax_scales", "absmax_offset"):
        np.testing.assert_array_equal(
            _bits(getattr(traced, name)), _bits(getattr(eager, name)), err_msg=name
        )


# --- torch's sum order ---------------------------------------------------------------------


def _vector(n, seed):
    """Signed values over six decades, where the order of the additions shows in the bits."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)


# Every length to 600 and beyond each boundary of the cascade (16, 256 and 4096 rows of 32
# values; level_power grows past 2**19 rows), with and without torch's thread split.
SUM_SIZES = [
    *range(1, 600),
    *(n + d for n in (8192, 131072, GRAIN_SIZE, 2 * GRAIN_SIZE) for d in (-1, 0, 1, 7, 8)),
    1_000_003,
]


def _torch_sum_bits(x):
    t = torch.from_numpy(x)
    return _bits(t.sum().numpy()), _bits(t.mean().numpy())


def test_torch_sum_is_torch_bitwise(one_torch_thread):
    """The NumPy evaluation of torch's order, for many lengths, against torch itself."""
    wrong = []
    for n in SUM_SIZES:
        x = _vector(n, n)
        if (_bits(torch_cpu_sum(x)), _bits(torch_cpu_mean(x))) != _torch_sum_bits(x):
            wrong.append(n)
    assert not wrong, f"lengths whose sum or mean differs from torch's: {wrong[:20]}"


def test_torch_sum_past_level_power_5(one_torch_thread):
    """From 2**19 rows (2**24 values) on, each level of the cascade takes runs of 32."""
    x = _vector(2**24 + 4099, 5)
    assert _bits(torch_cpu_sum(x)) == _torch_sum_bits(x)[0]


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_torch_sum_has_8_lanes_on_every_x86_capability(capability, tmp_path):
    """torch registers no AVX-512 sum kernel, and its AVX2 and generic ones both take 8 fp32
    lanes: the sums of a process forced to each (ATEN_CPU_CAPABILITY) are the same."""
    vectors = {f"n{n}": _vector(n, 7 * n) for n in (9, 100, 5184, 70001)}
    np.savez(tmp_path / "x.npz", **vectors)
    script = (
        "import sys, numpy as np, torch\n"
        "x = np.load(sys.argv[1])\n"
        "print(torch.backends.cpu.get_cpu_capability())\n"
        "for k in x.files: print(k, torch.from_numpy(x[k]).sum().numpy().view(np.uint32))\n"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", script, str(tmp_path / "x.npz")]
    run = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    out = run.stdout.split("\n")
    assert out[0] == capability.upper()
    got = dict(line.split() for line in out[1:] if line)
    for name, x in vectors.items():
        assert int(got[name]) == int(_bits(torch_cpu_sum(x))), name


@pytest.mark.parametrize("threads", [2, 3, 4, 7, 8, 16])
def test_torch_sum_follows_torch_threads(threads):
    """From GRAIN_SIZE values on torch sums one chunk per thread: emulated for any count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        wrong = []
        for n in (GRAIN_SIZE - 1, GRAIN_SIZE, 65537, 5 * GRAIN_SIZE + 3, 917_504):
            x = _vector(n, n + threads)
            if _bits(torch_cpu_sum(x, threads=threads)) != _torch_sum_bits(x)[0]:
                wrong.append(n)
        assert not wrong, f"{threads} threads: lengths whose sum differs from torch's: {wrong}"
    finally:
        torch.set_num_threads(before)


@needs_bitsandbytes
def test_bitsandbytes_offset_depends_on_torch_threads():
    """From 32,768 blocks on, bitsandbytes' offset depends on torch's thread count, and
    ``torch_cpu_mean(threads=T)`` is it for each T; nf4_quantize's is the one-thread offset.
    This (1024, 4096) weight has 65,536 blocks and offsets 2 ulps apart on 1 and 2 threads."""
    w_j, w_t = _weight((1024, 4096), "bfloat16", 0)
    _, plain = bnbf.quantize_4bit(w_t, quant_type="nf4", blocksize=64)
    absmax = plain.absmax.numpy()
    offsets = {}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 5):
            torch.set_num_threads(threads)
            _, state = bnbf.quantize_4bit(
                w_t, quant_type="nf4", blocksize=64, compress_statistics=True
            )
            offsets[threads] = _bits(state.offset.numpy())
            assert _bits(torch_cpu_mean(absmax, threads=threads)) == offsets[threads], threads
    finally:
        torch.set_num_threads(before)
    assert offsets[1] != offsets[2]
    assert _bits(nf4_quantize(w_j).absmax_offset) == offsets[1]


@pytest.mark.parametrize("n", [1, 7, 9, 33, 5184, 13824, 65537])
@pytest.mark.parametrize("threads", [1, 3])
def test_jitted_order_is_the_numpy_order(n, threads, one_torch_thread):
    """Under jit the same additions in the same order (XLA neither reorders them nor turns
    the division into a multiplication), so the bits equal the NumPy evaluation's."""
    x = _vector(n, 3 * n)
    mean = jax.jit(lambda v: torch_cpu_mean(v, threads=threads))(jnp.asarray(x))
    assert _bits(mean) == _bits(torch_cpu_mean(x, threads=threads))
    if threads == 1:
        assert _bits(mean) == _bits(torch.from_numpy(x).mean().numpy())


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"x_N must be a non-empty float32 vector"):
        torch_cpu_sum(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"x_N must be a non-empty float32 vector"):
        torch_cpu_sum(np.zeros(3, np.float64))
    with pytest.raises(ValueError, match=r"threads must be a positive integer, got threads=0"):
        torch_cpu_sum(np.ones(3, np.float32), threads=0)
