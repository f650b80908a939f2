"""Muon: momentum orthogonalized by Newton-Schulz for 2-D weights, AdamW for every other leaf."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from rudax._validation import (
    check_bool,
    check_finite,
    check_in_range,
    check_non_negative,
    check_positive,
    check_positive_int,
    float_dtype,
)
from rudax.optim._adam import adamw
from rudax.optim._inject import check_not_injected, static_arguments
from rudax.optim._precision import as_weak, map_in_compute_dtype, with_moment_dtype
from rudax.optim._torch_chain import DecayMask, decay_flags, torch_chain
from rudax.optim._torch_chain import _check_mask_leaf as check_mask_leaf
from rudax.optim._validation import check_gradients, check_learning_rate

# Keller Jordan's quintic, as torch.optim.Muon: maximal slope at zero, so few steps suffice;
# singular values land in a band around 1 rather than exactly on it, which does not hurt.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
_LAYOUTS = ("in_out", "out_in")


def _newton_schulz(
    update: jax.Array,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float | jax.Array,
    dtype: Any,
) -> jax.Array:
    """Approximates U V^T of update = U S V^T by a quintic Newton-Schulz iteration, as torch.

    Runs on the wide orientation (rows <= cols) so the Gram matrix is the smaller one. Each
    matmul accumulates in fp32 and the fp32 sum is rounded to ``dtype`` once, as torch's
    ``addmm`` does for its bf16 operands. A stack ``[..., rows, cols]`` is orthogonalized
    matrix by matrix, batched.
    """
    a, b, c = coefficients
    swap = lambda y: jnp.swapaxes(y, -1, -2)
    tall = update.shape[-2] > update.shape[-1]
    x = (swap(update) if tall else update).astype(dtype)
    f32 = lambda y: y.astype(jnp.float32)
    # Frobenius norm >= spectral norm, so every singular value starts in [0, 1].
    norm = _frobenius_norm(x)
    x = (f32(x) / jnp.maximum(norm, eps)).astype(dtype)
    # HIGHEST keeps fp32 matmuls out of TF32 on GPUs; it changes nothing for bf16 operands.
    mm = lambda p, q: jnp.matmul(
        p, q, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    for _ in range(steps):
        gram = mm(x, swap(x)).astype(dtype)
        poly = (b * f32(gram) + c * mm(gram, gram)).astype(dtype)
        x = (a * f32(x) + mm(poly, x)).astype(dtype)
    return swap(x) if tall else x


def _frobenius_norm(x: jax.Array) -> jax.Array:
    """The fp32 Frobenius norm of a matrix (a scalar) or of each matrix of a stack ``[..., 1, 1]``.

    A stack's are summed matrix by matrix, not over its last two axes at once: XLA sums an
    ``[L, m, n]`` array over those in another order than it sums an ``[m, n]`` one (on CPU,
    for ``[3, 32, 64]`` say), and each matrix of a stack must get the bits it gets as a leaf
    of its own. The price is L small reductions in the program instead of one.
    """
    norm = lambda m: jnp.sqrt(jnp.sum(jnp.square(m.astype(jnp.float32))))
    if x.ndim == 2:
        return norm(x)
    count = math.prod(x.shape[:-2])
    if count == 0:  # an empty stack: nothing to normalize
        return jnp.zeros((*x.shape[:-2], 1, 1), jnp.float32)
    norms = jnp.stack([norm(m) for m in x.reshape(count, *x.shape[-2:])])
    return norms.reshape(*x.shape[:-2], 1, 1)


def _lr_ratio(shape: tuple[int, ...], adjust_lr_fn: str | None, layout: str) -> float:
    rows, cols = shape
    if rows == 0 or cols == 0:
        # An empty matrix's update is empty whatever the ratio. torch's sqrt(max(1, A / B))
        # returns 1 for an empty (0, B) weight and divides by zero for an (A, 0) one.
        return 1.0
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    # torch's sqrt(max(1, A / B)) on its (out, in) weights: larger steps for layers that fan out.
    fan_in, fan_out = (rows, cols) if layout == "in_out" else (cols, rows)
    return math.sqrt(max(1.0, fan_out / fan_in))


def _refuse_complex(owner: str, what: str, tree: Any, selected: Any = None) -> None:
    """A TypeError naming the first complex leaf Muon would orthogonalize, and the fix."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    chosen = [True] * len(flat) if selected is None else jax.tree.leaves(selected)
    for (path, x), to_muon in zip(flat, chosen, strict=True):
        dtype = jnp.result_type(x)
        if to_muon and jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(
                f"{owner}: {what} {jax.tree_util.keystr(path)} has dtype={dtype}: Muon "
                "orthogonalizes real matrices and takes no complex parameters (neither does "
                "torch.optim.Muon). Split it into real and imaginary parameters, or send it to "
                "the AdamW part with muon_mask (AdamW steps it on its real view, as torch)."
            )


class MatrixStorage:
    """How Muon reads its leaves as matrices and orthogonalizes them: each array as it is.

    Muon's update is elementwise except for Newton-Schulz, which needs each matrix whole.
    ``rudax.optim.muon`` holds its matrices whole, one array per leaf (this class);
    ``rudax.sharding.fsdp_muon`` gives a subclass for leaves stored as FSDP shards, which
    gathers each matrix where it is orthogonalized. The elementwise steps (momentum, weight
    decay, learning rate) run on whatever the storage is.
    """

    def is_leaf(self, x: Any) -> bool:
        """Whether ``x`` is one leaf of Muon's (a node of several arrays may hold one matrix)."""
        del x
        return False

    def shape(self, x: Any) -> tuple[int, ...]:
        """The shape of the matrix (or stack of matrices, stack axes first) ``x`` holds."""
        return tuple(jnp.shape(x))

    def check(self, path: Any, x: Any) -> None:
        """Raises a ValueError naming ``params{path}`` if Muon cannot take ``x`` as stored."""
        del path, x

    def orthogonalize(
        self, tree: Any, newton_schulz: Callable[[jax.Array], jax.Array], dtype: Any
    ) -> Any:
        """``newton_schulz`` of each leaf's matrix (it casts to ``dtype`` first), as stored."""
        del dtype
        return jax.tree.map(newton_schulz, tree)


WHOLE = MatrixStorage()


def _check_matrix(path: Any, x: Any, *, stacked: bool, storage: MatrixStorage = WHOLE) -> None:
    """A ValueError naming a leaf Muon cannot take: not 2-D, or (stacked) of rank < 2."""
    storage.check(path, x)
    shape = storage.shape(x)
    ndim = len(shape)
    if ndim == 2 or (stacked and ndim > 2):
        return
    what = "2-D matrices and stacks of them" if stacked else "2-D matrices"
    hint = ""
    if ndim > 2:
        hint = (
            ", or pass stacked=True if its leading axes index a stack of matrices "
            "(rudax.layers.stack_layers)"
        )
    raise ValueError(
        f"Muon orthogonalizes {what}; params{jax.tree_util.keystr(path)} has shape "
        f"{shape}. Send it to the AdamW fallback with muon_mask{hint}."
    )


class ScaleByMuonState(NamedTuple):
    momentum: optax.Updates  # momentum buffer B_t, moment_dtype


_SCALE_BY_MUON_STATIC = (
    "nesterov",
    "ns_steps",
    "ns_coefficients",
    "adjust_lr_fn",
    "matrix_layout",
    "stacked",
    "ns_dtype",
    "moment_dtype",
)


@static_arguments(*_SCALE_BY_MUON_STATIC)
def scale_by_muon(
    momentum: float | jax.Array = 0.95,
    *,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float | jax.Array = 1e-7,
    adjust_lr_fn: str | None = None,
    matrix_layout: str = "in_out",
    stacked: bool = False,
    ns_dtype: DTypeLike = jnp.bfloat16,
    moment_dtype: DTypeLike | None = None,
) -> optax.GradientTransformation:
    """Muon's direction for a pytree of 2-D matrices: orthogonalized momentum (no lr, no decay).

    Per matrix with ``fan_in`` inputs and ``fan_out`` outputs, as ``torch.optim.Muon``::

        B_t = momentum B_{t-1} + (1 - momentum) g_t              (torch's buf.lerp_)
        M_t = (1 - momentum) g_t + momentum B_t  if nesterov else B_t
        O_t = NS(M_t) = quintic Newton-Schulz, ns_steps times, on M_t / max(||M_t||_F, eps)
        u_t = r O_t,  r = sqrt(max(1, fan_out / fan_in))       ("original", torch's default)
                      r = 0.2 sqrt(max(fan_in, fan_out))       ("match_rms_adamw", Moonshot)

    torch's docstring writes ``B_t = mu B_{t-1} + g_t``; its code (followed here) keeps an EMA.
    Newton-Schulz runs in ``ns_dtype``, bfloat16 by default as torch, on the transpose of a
    tall matrix; its output is returned in the parameters' dtype (the gradients' without params).

    **Layout.** torch computes ``r = sqrt(max(1, A / B))`` on a weight of shape ``(A, B)`` =
    ``(out, in)``. A flax kernel is ``(in, out)``, so the default ``matrix_layout="in_out"``
    reads ``fan_in, fan_out = A, B`` and gives the same ``r`` as torch for the same layer;
    ``"out_in"`` applies torch's formula to the array as it is. Only ``"original"`` depends on it.

    **Stacked layers.** With ``stacked=True`` a leaf of rank > 2, such as the ``[L, in, out]``
    kernel of layers stored stacked for ``lax.scan`` (``rudax.layers.stack_layers``), is a
    stack of matrices over its leading axes: each ``x[i, ..., :, :]`` gets its own
    Newton-Schulz, normalization and ratio ``r`` (of the last two dims), the update it would
    get as a leaf of its own (bit for bit op by op; under ``jit`` XLA may fuse and round the
    two programs differently). The momentum is elementwise either way.

    Args:
      momentum: EMA decay of the momentum buffer, in [0, 1).
      nesterov: use the Nesterov look-ahead ``M_t`` above.
      ns_steps: Newton-Schulz iterations, 1 to 99 (torch's bound).
      ns_coefficients: the quintic's ``(a, b, c)``: ``X <- a X + (b G + c G^2) X``, ``G = X X^T``.
      eps: lower bound of the Frobenius norm that normalizes ``M_t``.
      adjust_lr_fn: None or ``"original"`` (the same), or ``"match_rms_adamw"``.
      matrix_layout: ``"in_out"`` (flax kernels, the default) or ``"out_in"`` (torch weights).
      stacked: take a leaf of rank > 2 as a stack of matrices over its leading axes
        (see above). False (the default) refuses it, as a leaf that is not a matrix.
      ns_dtype: floating dtype of the Newton-Schulz iteration; ``jnp.float32`` for exactness.
      moment_dtype: storage dtype of the momentum buffer, e.g. ``jnp.float32`` for bf16
        parameters; None keeps each parameter's dtype. Each update is computed in the wider of
        this and the gradient's dtype and returned in the parameter's dtype.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a ``ScaleByMuonState``.
      Every leaf must be 2-D (of rank >= 2 with ``stacked=True``): a ``ValueError`` names the
      first that is not; and real: a ``TypeError`` names the first complex one. An empty
      ``(0, n)`` or ``(n, 0)`` matrix gets an empty update (torch's ``"original"`` ratio
      divides by zero for one of the two).
      ``momentum`` and ``eps`` may be injected (``rudax.optim.inject_hyperparams``); the
      other arguments shape the program and are static.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> import rudax.optim as ro
      >>> g = jax.random.normal(jax.random.key(0), (32, 16))  # fan_out < fan_in: r = 1
      >>> tx = ro.scale_by_muon(momentum=0.0, ns_dtype=jnp.float32)
      >>> u, _ = tx.update(g, tx.init(g))
      >>> bool(np.all((np.linalg.svd(u, compute_uv=False) > 0.6)))
      True

    References:
      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024; Liu et al., `Muon is Scalable for
      LLM Training <https://arxiv.org/abs/2502.16982>`_, 2025; ``torch.optim.Muon``.
    """
    return _scale_by_muon(
        momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        ns_coefficients=ns_coefficients,
        eps=eps,
        adjust_lr_fn=adjust_lr_fn,
        matrix_layout=matrix_layout,
        stacked=stacked,
        ns_dtype=ns_dtype,
        moment_dtype=moment_dtype,
        storage=WHOLE,
    )


def _scale_by_muon(
    momentum: float | jax.Array = 0.95,
    *,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float | jax.Array = 1e-7,
    adjust_lr_fn: str | None = None,
    matrix_layout: str = "in_out",
    stacked: bool = False,
    ns_dtype: DTypeLike = jnp.bfloat16,
    moment_dtype: DTypeLike | None = None,
    storage: MatrixStorage,
) -> optax.GradientTransformation:
    """scale_by_muon on the matrices ``storage`` reads (rudax.sharding.fsdp_muon's shards)."""
    check_not_injected(
        "scale_by_muon", dict(ns_steps=ns_steps, ns_dtype=ns_dtype, moment_dtype=moment_dtype)
    )
    check_in_range("momentum", momentum, 0.0, 1.0)
    check_bool("nesterov", nesterov)
    check_bool("stacked", stacked)
    check_positive_int("ns_steps", ns_steps)
    if ns_steps >= 100:
        raise ValueError(f"ns_steps must be < 100 (torch.optim.Muon's bound), got {ns_steps=}")
    coefficients = _check_coefficients(ns_coefficients)
    check_positive("eps", eps)
    if adjust_lr_fn not in _ADJUST_LR_FNS:
        raise ValueError(
            f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn=}"
        )
    if matrix_layout not in _LAYOUTS:
        raise ValueError(f"matrix_layout must be 'in_out' or 'out_in', got {matrix_layout=}")
    float_dtype("ns_dtype", ns_dtype, none_in_message=True)
    if ns_dtype is None:
        raise TypeError(f"ns_dtype must be a floating dtype, got {ns_dtype=}")
    momentum, eps = as_weak(momentum), as_weak(eps)
    check_matrices = lambda tree: jax.tree_util.tree_map_with_path(
        lambda path, x: _check_matrix(path, x, stacked=stacked, storage=storage),
        tree,
        is_leaf=storage.is_leaf,
    )
    newton_schulz = lambda m: _newton_schulz(m, coefficients, ns_steps, eps, ns_dtype)

    def init_fn(params: optax.Params) -> ScaleByMuonState:
        check_matrices(params)
        return ScaleByMuonState(momentum=jax.tree.map(jnp.zeros_like, params))

    def update_fn(updates, state, params=None):
        del params
        check_matrices(updates)

        def leaf(g, buf):
            buf = momentum * buf + (1.0 - momentum) * g
            m = (1.0 - momentum) * g + momentum * buf if nesterov else buf
            return m, buf

        # Elementwise on the storage; then Newton-Schulz, which needs each matrix whole, where
        # the storage keeps it. m is in the compute dtype, u as well.
        m, buf = map_in_compute_dtype(
            leaf, updates, state.momentum, owner="scale_by_muon", names=("momentum",)
        )
        o = storage.orthogonalize(m, newton_schulz, ns_dtype)

        def scaled(o_leaf, m_leaf):
            ratio = _lr_ratio(storage.shape(m_leaf)[-2:], adjust_lr_fn, matrix_layout)
            return jax.tree.map(lambda o, m: ratio * o.astype(m.dtype), o_leaf, m_leaf)

        u = jax.tree.map(scaled, o, m, is_leaf=storage.is_leaf)
        return u, ScaleByMuonState(momentum=buf)

    tx = with_moment_dtype(
        optax.GradientTransformation(init_fn, update_fn),
        moment_dtype,
        owner="scale_by_muon",
        allow_complex=False,
    )

    def checked_init(params: optax.Params) -> optax.OptState:
        _refuse_complex("scale_by_muon", "parameter", params)
        return tx.init(params)

    def checked_update(updates, state, params=None, **extra_args):
        _refuse_complex("scale_by_muon", "gradient", updates)
        if params is not None:
            _refuse_complex("scale_by_muon", "parameter", params)
        return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(checked_init, checked_update)


def _check_coefficients(value: Any) -> tuple[float, float, float]:
    if not isinstance(value, Sequence) or len(value) != 3:
        raise TypeError(f"ns_coefficients must be three numbers (a, b, c), got {value=}")
    for i, x in enumerate(value):
        check_finite(f"ns_coefficients[{i}]", x)
    a, b, c = (float(x) for x in value)
    return a, b, c


MaskSpec = Any | Callable[[optax.Params], Any] | None


def _muon_labels(
    muon_mask: MaskSpec, stacked: bool, storage: MatrixStorage
) -> Callable[[optax.Params], Any]:
    """Turns muon_mask into optax.partition's labels ("muon" or "adamw", one per leaf).

    The mask is matched to the parameters by path, not by tree type, so a plain dict mask
    works for ``nnx.State`` parameters; a mismatch names the first path that differs. A leaf
    is one of ``storage``'s (an FSDP ``ShardedParameter`` node counts as one): the labels are
    then a prefix of the parameters' tree, which ``optax.partition`` takes.
    """
    is_leaf = storage.is_leaf

    def labels(params):
        if muon_mask is None:
            mask = jax.tree.map(lambda p: len(storage.shape(p)) == 2, params, is_leaf=is_leaf)
        else:
            mask = muon_mask(params) if callable(muon_mask) else muon_mask
        keystr = jax.tree_util.keystr
        flat = jax.tree_util.tree_flatten_with_path
        by_path = {keystr(k): v for k, v in flat(mask, is_leaf=is_leaf)[0]}
        param_paths = {keystr(k) for k, _ in flat(params, is_leaf=is_leaf)[0]}
        extra = sorted(by_path.keys() - param_paths)
        if extra:
            raise ValueError(f"muon_mask{extra[0]} has no matching leaf in params")

        def label(path, p):
            key = keystr(path)
            if key not in by_path:
                raise ValueError(f"muon_mask has no entry for params{key}; it must match params")
            selected = by_path[key]
            if is_leaf(selected):  # the mask mapped over a leaf's arrays, not over its leaves
                raise TypeError(
                    f"muon_mask{key} must be a bool, got a {type(selected).__name__}: map the "
                    f"mask with is_leaf=lambda x: isinstance(x, {type(selected).__name__})"
                )
            if not isinstance(selected, bool | np.bool_):
                raise TypeError(f"muon_mask{key} must be a bool, got {selected!r}")
            if selected:
                _check_matrix(path, p, stacked=stacked, storage=storage)
            return "muon" if selected else "adamw"

        return jax.tree_util.tree_map_with_path(label, params, is_leaf=is_leaf)

    return labels


@static_arguments(*_SCALE_BY_MUON_STATIC, "muon_mask", "mask")
def muon(
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: float | jax.Array = 0.1,
    momentum: float | jax.Array = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    *,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float | jax.Array = 1e-7,
    adjust_lr_fn: str | None = None,
    matrix_layout: str = "in_out",
    stacked: bool = False,
    muon_mask: MaskSpec = None,
    adamw_learning_rate: optax.ScalarOrSchedule | None = None,
    adamw_b1: float | jax.Array = 0.9,
    adamw_b2: float | jax.Array = 0.999,
    adamw_eps: float | jax.Array = 1e-8,
    adamw_weight_decay: float | jax.Array | None = None,
    ns_dtype: DTypeLike = jnp.bfloat16,
    moment_dtype: DTypeLike | None = None,
    mask: DecayMask = None,
) -> optax.GradientTransformation:
    """Muon on 2-D weight matrices (as ``torch.optim.Muon``), torch-style AdamW on the rest.

    A leaf selected by ``muon_mask`` (default: every 2-D leaf) with direction ``u_t`` from
    :func:`scale_by_muon` (orthogonalized momentum times the shape's lr ratio) is updated as::

        p_t = p_{t-1} (1 - lr_t weight_decay) - lr_t u_t

    Every other leaf (biases, norms, scalars, >2-D kernels, and any 2-D leaf the mask
    excludes, such as embeddings or the output head) follows ``torch.optim.AdamW``, as
    ``rudax.optim.adamw`` with the ``adamw_*`` arguments::

        p_t = p_{t-1} (1 - lr'_t wd') - lr'_t (m_t / c1) / (sqrt(v_t / c2) + adamw_eps)

    with ``m, v`` EMAs of ``g`` and ``g^2`` (decays ``adamw_b1, adamw_b2``) and
    ``c_i = 1 - b_i**t``. torch's Muon only accepts 2-D parameters and leaves the rest to a
    second optimizer; here one transformation holds both (``optax.partition``). optax has no
    Muon with this rule (``optax.contrib.muon`` differs in its momentum, scaling and decay).

    **Which leaves decay.** ``mask=`` says which parameters decay, whichever part steps them:
    a leaf it leaves out takes ``weight_decay = 0`` in Muon's rule or ``wd' = 0`` in AdamW's,
    as a torch parameter group with ``weight_decay=0`` does in ``torch.optim.Muon`` and in
    ``torch.optim.AdamW``. One mask for the parameters, not one per part, because what is
    exempt (biases, norms, embeddings) is a property of the parameter, and ``muon_mask`` may
    send a 2-D leaf to either part. (``optax.contrib.muon``'s ``weight_decay_mask`` masks only
    its Muon part.) Usually only AdamW's leaves need it: biases and norms are not 2-D.

    Complex parameters: a leaf sent to Muon must be real (a TypeError naming it, as
    ``torch.optim.Muon`` refuses them); a leaf sent to AdamW follows AdamW, on its real view.

    **FSDP.** Parameters sharded by ``rudax.sharding`` (``ShardedParameter``: a flat 1/N of
    each on each device) take ``rudax.sharding.fsdp_muon``, the same optimizer with the
    same arguments plus the mesh: it orthogonalizes each matrix whole, on one device.

    Args:
      learning_rate: Muon's learning rate, a float >= 0 or a schedule of the update count.
      weight_decay: Muon's decoupled weight decay, >= 0 (torch's default 0.1).
      momentum: EMA decay of the momentum buffer, in [0, 1).
      nesterov: use Nesterov momentum.
      ns_steps: Newton-Schulz iterations, 1 to 99.
      ns_coefficients: the quintic's ``(a, b, c)``, torch's defaults.
      eps: lower bound of the norm that normalizes the momentum before Newton-Schulz.
      adjust_lr_fn: None or ``"original"`` (``sqrt(max(1, fan_out / fan_in))``, torch's
        default) or ``"match_rms_adamw"`` (``0.2 sqrt(max(fan_in, fan_out))``, which lets Muon
        reuse AdamW's lr and decay).
      matrix_layout: ``"in_out"`` (flax kernels, the default) or ``"out_in"`` (torch
        weights): which axis is fan_in for ``"original"``; see :func:`scale_by_muon`.
      stacked: Muon takes a selected leaf of rank > 2 as a stack of matrices over its
        leading axes (layers stored stacked, ``rudax.layers.stack_layers``), each stepped as
        a leaf of its own; see :func:`scale_by_muon`. False (the default) refuses it.
      muon_mask: which leaves Muon takes: None (every 2-D leaf), a pytree of bools with the
        params' paths, or a callable of the params (of the updates, in ``update``) returning
        one. A selected leaf must be 2-D (of rank >= 2 with ``stacked=True``). The default
        takes no stacked kernel ``[L, in, out]`` and does take a stacked bias ``[L, out]``:
        give stacked layers a mask.
      adamw_learning_rate: the fallback's learning rate; None reuses ``learning_rate``.
      adamw_b1: the fallback's first-moment decay, in [0, 1).
      adamw_b2: the fallback's second-moment decay, in [0, 1).
      adamw_eps: the fallback's eps, outside the square root, >= 0.
      adamw_weight_decay: the fallback's decoupled weight decay; None reuses ``weight_decay``.
      ns_dtype: dtype of the Newton-Schulz iteration: bfloat16 as torch, or ``jnp.float32``.
      moment_dtype: storage dtype of every buffer (Muon's momentum, AdamW's moments), e.g.
        ``jnp.float32`` for bf16 parameters; None keeps each parameter's dtype. Each update is
        computed in the wider of this and the gradient's dtype and returned in the parameter's
        dtype.
      mask: which parameters decay, in both parts, as in ``optax.add_decayed_weights``: a
        pytree of bools like the parameters (or a prefix of it), or a callable of the
        parameters returning one. A False leaf still gets its step, without decay. None
        decays all.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` around an ``optax.partition`` of the two
      chains (its state is the partition's). Its ``update`` needs ``params``. The arguments
      that shape the program (``nesterov``, ``ns_steps``, ``ns_coefficients``,
      ``adjust_lr_fn``, ``matrix_layout``, ``stacked``, ``muon_mask``, ``ns_dtype``,
      ``moment_dtype``, ``mask``) are static under ``rudax.optim.inject_hyperparams``; with
      ``optax.inject_hyperparams`` pass them as ``static_args``. The float ones may be injected.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import rudax.optim as ro
      >>> params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
      >>> x = jnp.arange(8.0).reshape(2, 4)
      >>> loss = lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2)
      >>> tx = ro.muon(0.02, adamw_learning_rate=3e-4)  # "w" to Muon, "b" to AdamW
      >>> state = tx.init(params)
      >>> updates, state = tx.update(jax.grad(loss)(params), state, params)
      >>> bool(loss(optax.apply_updates(params, updates)) < loss(params))
      True
      >>> no_decay_for_vectors = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
      >>> tx = ro.muon(0.02, adamw_learning_rate=3e-4, mask=no_decay_for_vectors)
      >>> zero = jax.tree.map(jnp.zeros_like, params)  # zero gradients: only the decay acts
      >>> updates, _ = tx.update(zero, tx.init(params), {**params, "b": jnp.ones(3)})
      >>> round(float(updates["w"][0, 0]), 6), updates["b"].tolist()  # -lr wd w; no decay
      (-0.002, [-0.0, -0.0, -0.0])

    References:
      Jordan et al., `Muon: An optimizer for hidden layers in neural networks
      <https://kellerjordan.github.io/posts/muon/>`_, 2024; Liu et al., `Muon is Scalable for
      LLM Training <https://arxiv.org/abs/2502.16982>`_, 2025; ``torch.optim.Muon``,
      ``torch.optim.AdamW``; Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019.
    """
    return _muon(
        learning_rate,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        ns_coefficients=ns_coefficients,
        eps=eps,
        adjust_lr_fn=adjust_lr_fn,
        matrix_layout=matrix_layout,
        stacked=stacked,
        muon_mask=muon_mask,
        adamw_learning_rate=adamw_learning_rate,
        adamw_b1=adamw_b1,
        adamw_b2=adamw_b2,
        adamw_eps=adamw_eps,
        adamw_weight_decay=adamw_weight_decay,
        ns_dtype=ns_dtype,
        moment_dtype=moment_dtype,
        mask=mask,
        storage=WHOLE,
        owner="muon",
    )


def _muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    # every argument given by muon or rudax.sharding.fsdp_muon, whose signatures hold the
    # defaults (one place each: a test keeps the two alike)
    weight_decay: float | jax.Array,
    momentum: float | jax.Array,
    nesterov: bool,
    ns_steps: int,
    ns_coefficients: tuple[float, float, float],
    eps: float | jax.Array,
    adjust_lr_fn: str | None,
    matrix_layout: str,
    stacked: bool,
    muon_mask: MaskSpec,
    adamw_learning_rate: optax.ScalarOrSchedule | None,
    adamw_b1: float | jax.Array,
    adamw_b2: float | jax.Array,
    adamw_eps: float | jax.Array,
    adamw_weight_decay: float | jax.Array | None,
    ns_dtype: DTypeLike,
    moment_dtype: DTypeLike | None,
    mask: DecayMask,
    storage: MatrixStorage,
    owner: str,
) -> optax.GradientTransformation:
    """muon on the matrices ``storage`` reads (``rudax.sharding.fsdp_muon``'s shards);
    errors name ``owner``."""
    check_not_injected(
        owner,
        dict(
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            moment_dtype=moment_dtype,
            muon_mask=muon_mask,
            mask=mask,
        ),
    )
    check_learning_rate(learning_rate)
    check_non_negative("weight_decay", weight_decay)
    if adamw_learning_rate is not None:
        check_learning_rate(adamw_learning_rate, "adamw_learning_rate")
    check_in_range("adamw_b1", adamw_b1, 0.0, 1.0)
    check_in_range("adamw_b2", adamw_b2, 0.0, 1.0)
    check_non_negative("adamw_eps", adamw_eps)
    if adamw_weight_decay is not None:
        check_non_negative("adamw_weight_decay", adamw_weight_decay)
    direction = _scale_by_muon(
        momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        ns_coefficients=ns_coefficients,
        eps=eps,
        adjust_lr_fn=adjust_lr_fn,
        matrix_layout=matrix_layout,
        stacked=stacked,
        ns_dtype=ns_dtype,
        storage=storage,
    )
    labels = _muon_labels(muon_mask, stacked, storage)

    def partitioned(decay_mask: DecayMask) -> optax.GradientTransformation:
        # moment_dtype=None inside: torch_chain and adamw apply it to their whole chains.
        muon_chain = torch_chain(
            [direction],
            learning_rate,
            weight_decay,
            moment_dtype,
            name="muon",
            decoupled=True,
            mask=decay_mask,
            allow_complex=False,
        )
        adamw_chain = adamw(
            learning_rate if adamw_learning_rate is None else adamw_learning_rate,
            adamw_b1,
            adamw_b2,
            adamw_eps,
            weight_decay if adamw_weight_decay is None else adamw_weight_decay,
            moment_dtype=moment_dtype,
            mask=decay_mask,
        )
        return optax.partition({"muon": muon_chain, "adamw": adamw_chain}, labels)

    # Every chain has the same state whatever the mask (add_decayed_weights keeps none), so
    # one built without it initializes the state for all.
    plain = partitioned(None)
    if mask is not None and not callable(mask):
        # Checked at construction too, so a typo fails before any data is loaded.
        for path, keep in jax.tree_util.tree_flatten_with_path(mask)[0]:
            check_mask_leaf(owner, path, keep)

    def init_fn(params):
        _refuse_complex(owner, "parameter", params, _to_muon(labels, params, storage))
        return plain.init(params)

    def update_fn(updates, state, params=None, **extra_args):
        # Before the partition: its masks are built from the gradients' tree.
        check_gradients(owner, updates, params)
        selected = _to_muon(labels, updates, storage)
        _refuse_complex(owner, "gradient", updates, selected)
        if params is not None:
            _refuse_complex(owner, "parameter", params, selected)
        if mask is None or params is None:
            tx = plain
        else:
            # Resolved here, on the whole tree: inside the partition each part sees the
            # parameters with the other part's leaves masked out, which a callable of the
            # parameters should not have to handle. One bool per leaf serves both parts.
            flags = iter(decay_flags(mask, params, owner=owner))
            # One bool per storage leaf (a ShardedParameter, not its array), a prefix of the
            # parameters' tree as the partition's labels are: the part that does not take a
            # leaf sees it masked out whole.
            leaves, treedef = jax.tree.flatten(params, is_leaf=storage.is_leaf)
            per_leaf = [all([next(flags) for _ in jax.tree.leaves(x)]) for x in leaves]
            tx = partitioned(treedef.unflatten(per_leaf))
        return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _to_muon(labels: Callable[[optax.Params], Any], tree: Any, storage: MatrixStorage) -> Any:
    """True where ``labels`` sends a leaf to Muon, False where to AdamW: one bool per array
    leaf of ``tree`` (a storage leaf's label covers each of its arrays)."""
    flags = jax.tree.map(lambda label: label == "muon", labels(tree))
    return jax.tree.map(
        lambda flag, sub: jax.tree.map(lambda _: flag, sub), flags, tree, is_leaf=storage.is_leaf
    )
