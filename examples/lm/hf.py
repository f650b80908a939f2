"""Hugging Face Llama-format checkpoints in and out of the GPT: ``load_hf``, ``save_hf``, export.

    python -m examples.lm.hf export runs/<name> <dir>    # a run's latest weights -> HF format

A checkpoint directory is what ``transformers``' ``save_pretrained`` writes: ``config.json``
and ``model.safetensors``, or shards listed by ``model.safetensors.index.json``, and often a
``tokenizer.json``. ``load_hf`` reads a ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM``) one into
``examples.lm.model.GPT``, tensor by tensor; ``save_hf`` writes a GPT as one that
``transformers.AutoModelForCausalLM.from_pretrained`` loads. The two models are the same
function (pre-norm RMSNorm blocks, rotate-half RoPE, grouped-query attention, SwiGLU), so the
conversion is names and transposes only::

    GPT path (nnx)                 HF tensor                                   layout
    embed.embedding                model.embed_tokens.weight                   [V, d] both
    blocks[i].attn_norm.scale      model.layers.{i}.input_layernorm.weight
    blocks[i].attn.q.kernel        model.layers.{i}.self_attn.q_proj.weight    [in, out] vs
      (k, v, out)                    (k_proj, v_proj, o_proj; .bias: Qwen2)    torch's [out, in]
    blocks[i].mlp_norm.scale       model.layers.{i}.post_attention_layernorm.weight
    blocks[i].mlp.gate.kernel      model.layers.{i}.mlp.gate_proj.weight       transposed too
      (up, down)                     (up_proj, down_proj)
    norm.scale                     model.norm.weight
    head.embedding                 lm_head.weight (untied heads only)          [V, d] both

``hf_module_name`` is that table's module part, the ``ModuleNames`` function that
``rudax.layers.apply_lora`` and the PEFT adapter files take: LoRA targets and adapter keys are
HF's names (``q_proj``, ``model.layers.0.self_attn.q_proj``). A fused ``qkv`` projection has
no HF name; ``save_hf`` splits it into q, k and v, and ``load_hf`` builds separate ones.

Nothing is guessed: a config field ``examples/lm/hf_config.py`` does not know, a RoPE type
it does not implement, a missing, unexpected or misshapen tensor is a ValueError naming it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

import rudax.checkpoint as rc
import rudax.kernels as rk
import rudax.layers as rl
import rudax.sharding as rs
from examples.lm.config import UsageError
from examples.lm.hf_config import CONFIG, config_from_hf, config_to_hf
from examples.lm.model import GPT, Block, GPTConfig, shard
from rudax.models import open_checkpoint

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"

# ------------------------------------------------------------------------------- names

_TOP = {"embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn": "self_attn",
    "mlp_norm": "post_attention_layernorm",
    "mlp": "mlp",
}
_ATTN = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "out": "o_proj"}
_MLP = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
# nnx variable name -> (HF parameter name, stored transposed): torch's Linear keeps
# weight [out, in], rudax's Linear kernel [in, out].
_LEAVES = {
    "kernel": ("weight", True),
    "bias": ("bias", False),
    "scale": ("weight", False),
    "embedding": ("weight", False),
}


def hf_module_name(path: tuple[str | int, ...]) -> str | None:
    """The transformers ``LlamaForCausalLM`` module name of the GPT's module at ``path``.

    ``path`` is the module's nnx path inside the GPT (the keys of ``nnx.iter_graph``, as
    attribute access uses them); the name is the one peft's ``target_modules`` and adapter
    keys use. Modules with no counterpart (a fused ``qkv``, the parts of an MoE, the GPT
    itself, anything inside a module) are None.

    Args:
      path: a tuple of attribute names and list indices, e.g. ``("blocks", 0, "attn", "q")``.

    Returns:
      The HF module name, e.g. ``"model.layers.0.self_attn.q_proj"``, or None.

    Example:
      >>> from examples.lm.hf import hf_module_name
      >>> hf_module_name(("blocks", 3, "mlp", "down")), hf_module_name(("head",))
      ('model.layers.3.mlp.down_proj', 'lm_head')
      >>> hf_module_name(("blocks", 0, "attn", "qkv")) is None  # fused: no HF name
      True
    """
    match tuple(path):
        case (str(top),) if top in _TOP:
            return _TOP[top]
        case ("blocks",):
            return "model.layers"
        case ("blocks", int(i)):
            return f"model.layers.{i}"
        case ("blocks", int(i), str(part)) if part in _BLOCK:
            return f"model.layers.{i}.{_BLOCK[part]}"
        case ("blocks", int(i), "attn", str(proj)) if proj in _ATTN:
            return f"model.layers.{i}.self_attn.{_ATTN[proj]}"
        case ("blocks", int(i), "mlp", str(proj)) if proj in _MLP:
            return f"model.layers.{i}.mlp.{_MLP[proj]}"
    return None


def _tensor_name(path: tuple[Any, ...]) -> tuple[str, bool]:
    """(HF tensor name, transposed) of the GPT variable at path; ValueError if it has none."""
    module = hf_module_name(path[:-1])
    if module is None or path[-1] not in _LEAVES:
        raise ValueError(f"the GPT variable {_where(path)} has no Hugging Face tensor name")
    name, transposed = _LEAVES[path[-1]]
    return f"{module}.{name}", transposed


def _where(path: tuple[Any, ...]) -> str:
    return "model" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)


# ------------------------------------------------------------------------------- load


def load_hf(
    directory: str | os.PathLike,
    *,
    param_dtype: Any = None,
    dtype: Any = None,
    quantize: str | None = None,
    on_tensor: Callable[[str, np.ndarray], None] | None = None,
) -> GPT:
    """A ``GPT`` holding a Hugging Face ``LlamaForCausalLM`` (or Qwen2) checkpoint's weights.

    The model is built abstractly (``nnx.eval_shape``: no random weights are drawn) and each
    parameter filled from its tensor, read alone (``rudax.models.SafetensorsFile``, into
    memory the device adopts on the CPU) and cast or transposed on the device, so the host
    holds at most two copies of one tensor beside the model, never a whole file. The GPT has
    separate q/k/v projections (``fused_qkv=False``), in which LoRA on one of them is exact,
    and computes what transformers' model computes (same RMSNorm, RoPE, GQA; RoPE's angles
    are more exact here, in float64).

    ``quantize="nf4"`` makes every attention and MLP projection a ``rudax.layers.NF4Linear``
    as it is read: the ``[out, in]`` tensor, in ``param_dtype``, goes through
    ``rudax.kernels.nf4_quantize`` (double quantization, blocks of 64; the codes
    ``transformers`` with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True)`` makes) a chunk at a time, so that beside the model
    being built the host holds the tensor just read, its ``param_dtype`` copy when that
    differs, and one chunk; the whole model in ``param_dtype`` never exists. The embedding,
    the norms and an untied head stay in ``param_dtype`` (as bitsandbytes leaves them).

    A projection holding NaN or inf is refused under ``quantize="nf4"`` (NF4 cannot store
    it, and ``nf4_quantize``'s block maxima would hide it). ``lm_head.weight`` in a tied
    checkpoint must equal the embedding; RoPE ``inv_freq`` buffers (older checkpoints) must
    equal this model's frequencies. Any other tensor the model does not have, or one it has
    that is missing or of another shape, is an error.

    Args:
      directory: the checkpoint directory (``config.json`` and ``model.safetensors``, or the
        shards of ``model.safetensors.index.json``).
      param_dtype: storage dtype (bf16, fp16, fp32); None for the checkpoint's.
      dtype: compute dtype; None for ``param_dtype``.
      quantize: None, or ``"nf4"`` for the projections as above.
      on_tensor: called as ``on_tensor(name, array)`` with each tensor the model takes, as
        stored (before any cast), in a fixed order: e.g. to hash the base a run was tuned on.
        The array is read-only (on the CPU the model may hold its very memory).

    Returns:
      The ``GPT``; ``model.config`` is its ``GPTConfig``.

    Example:
      >>> import tempfile
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from examples.lm.hf import load_hf, save_hf
      >>> from examples.lm.model import GPT, GPTConfig
      >>> config = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=1, n_heads=4,
      ...                    n_kv_heads=2, param_dtype=jnp.float32, dtype=jnp.float32)
      >>> model = GPT(config, rngs=nnx.Rngs(0))
      >>> directory = tempfile.mkdtemp()
      >>> save_hf(model, directory)
      >>> loaded = load_hf(directory)
      >>> loaded.config.fused_qkv, loaded.blocks[0].attn.k.kernel.shape
      (False, (32, 16))
      >>> # k's kernel is columns 32:48 of the fused [q | k | v] kernel, saved as HF's k_proj.
      >>> k = model.blocks[0].attn.qkv.kernel[:, 32:48]
      >>> bool(jnp.array_equal(loaded.blocks[0].attn.k.kernel[...], k))
      True
    """
    directory = Path(directory)
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize=}")
    config = config_from_hf(_read_json(directory / CONFIG), param_dtype=param_dtype, dtype=dtype)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))))
    wanted = {}
    for path, var in nnx.to_flat_state(state):
        name, transposed = _tensor_name(path)
        wanted[name] = (path, var, transposed)
    # Projections to quantize: module path -> the names of its weight and (Qwen2) bias.
    packed = {} if quantize is None else _projections(wanted)
    quantized: dict[tuple[Any, ...], dict[str, Any]] = {path: {} for path in packed}
    files = open_checkpoint(directory)
    missing = [name for name in wanted if name not in files]
    if missing:
        raise ValueError(
            f"{directory}: the checkpoint lacks {missing[0]} ({len(missing)} missing in all), "
            f"which its {CONFIG} implies"
        )
    for name in sorted(set(files) - set(wanted)):
        _check_extra(name, files, config, directory)
    for name, (path, var, transposed) in wanted.items():
        tensor = files[name].get_tensor(name)
        want = var.get_value().shape[::-1] if transposed else var.get_value().shape
        if tensor.shape != want:
            raise ValueError(
                f"{directory}: {name} has shape {tensor.shape}; {CONFIG} makes it {want} "
                f"({_where(path)})"
            )
        if not jnp.issubdtype(tensor.dtype, jnp.floating):  # NumPy: not bf16
            raise ValueError(f"{directory}: {name} has dtype {tensor.dtype}, not floating")
        if on_tensor is not None:
            on_tensor(name, tensor)
        if path[:-1] in packed:
            if path[-1] == "kernel" and not np.isfinite(tensor).all():
                # NF4's per-block absmax would hide a NaN (XLA:CPU's max drops it) or turn an
                # inf into garbage: the quantized model would compute finite, wrong outputs.
                raise ValueError(
                    f"{directory}: {name} holds non-finite values (NaN or inf), which NF4 "
                    "cannot store: the checkpoint is damaged, or load it with quantize=None"
                )
            try:
                part = _quantized(tensor, path, config.param_dtype)
            except ValueError as e:  # a size NF4's blocks do not divide
                raise ValueError(
                    f"{directory}: {name} cannot be quantized to NF4 ({e}); load it "
                    "with quantize=None"
                ) from e
            quantized[path[:-1]][path[-1]] = part
        else:
            # On the CPU the device adopts the tensor as read; a transpose or a cast makes
            # the one other copy, on the device, after which the read one is freed.
            value = jax.device_put(tensor)
            if transposed or value.dtype != config.param_dtype:
                value = _as_param(value, transposed, config.param_dtype)
            var.set_value(jax.block_until_ready(value))
        del tensor
    model = nnx.merge(graphdef, state)
    for path, parts in quantized.items():
        linear = _module_at(model, path)
        layer = rl.NF4Linear(parts["kernel"], parts.get("bias"), dtype=linear.dtype)
        setattr(_module_at(model, path[:-1]), path[-1], layer)
    return model


# Quantization formats load_hf takes.
QUANTIZE = (None, "nf4")
# Elements quantized per step. Small and of one size: each step's device copy and fp32
# temporaries (about 1 MiB) are freed and the next step's take the same blocks, so glibc's
# heap does not fill with holes of each tensor's size. Measured on an earlier, smaller
# configuration of tests/lm/test_hf_nf4.py (before tensors were read into adopted memory):
# a peak of 53-76 MB above the start with chunks of 2**20, 37-38 MB with 2**16, of a 42 MB
# bound. Quantizing a 200M-parameter model this way is a few thousand small steps.
_QUANTIZE_CHUNK = 2**16


@functools.partial(jax.jit, static_argnums=(1, 2))
def _as_param(x: jax.Array, transposed: bool, dtype: Any) -> jax.Array:
    return (x.T if transposed else x).astype(dtype)


def _projections(wanted: dict[str, Any]) -> set[tuple[Any, ...]]:
    """The module paths of the blocks' attention and MLP projections (rudax Linear layers)."""
    return {
        path[:-1]
        for path, _, _ in wanted.values()
        if len(path) == 5
        and path[0] == "blocks"
        and path[2] in ("attn", "mlp")
        and (path[3] in _ATTN or path[3] in _MLP)
        and path[4] == "kernel"
    }


def _quantized(tensor: np.ndarray, path: tuple[Any, ...], param_dtype: Any) -> Any:
    """A projection's weight as an NF4Tensor of its [out, in] layout; a bias in param_dtype."""
    if path[-1] == "bias":
        return jnp.asarray(tensor, param_dtype)
    # Rounded to param_dtype first (on the host, round to nearest even as XLA does), as
    # transformers loads a checkpoint in torch_dtype before bitsandbytes quantizes it.
    tensor = tensor.astype(param_dtype, copy=False)
    # Waited for: JAX dispatches asynchronously, and until the chunks are quantized their
    # device copies (and through them the tensor) stay alive while the next tensors are read.
    return jax.block_until_ready(rk.nf4_quantize(tensor, chunk_size=_QUANTIZE_CHUNK))


def _module_at(model: nnx.Module, path: tuple[Any, ...]) -> Any:
    node: Any = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


_INV_FREQ = re.compile(r"model\.layers\.(\d+)\.self_attn\.rotary_emb\.inv_freq")


def _check_extra(name: str, files: dict[str, Any], config: GPTConfig, directory: Path) -> None:
    """A tensor the GPT has no parameter for: accepted only if it is redundant and agrees."""
    if name == "lm_head.weight" and config.tie_embeddings:
        head = files[name].get_tensor(name)
        embed = files["model.embed_tokens.weight"].get_tensor("model.embed_tokens.weight")
        if head.shape != embed.shape or not np.array_equal(head, embed):
            raise ValueError(
                f"{directory}: tie_word_embeddings is true but lm_head.weight differs from "
                "model.embed_tokens.weight; set tie_word_embeddings to false to load both"
            )
        return
    match = _INV_FREQ.fullmatch(name)
    if match and int(match.group(1)) < config.n_layers:
        # A buffer older transformers saved: RoPE's frequencies, which this model computes.
        ours = rl.rope_frequencies(
            config.head_dim, theta=config.rope_theta, scaling=config.rope_scaling
        )
        theirs = files[name].get_tensor(name).astype(np.float64)
        if theirs.shape != ours.shape or not np.allclose(theirs, ours, rtol=1e-6, atol=0):
            raise ValueError(
                f"{directory}: {name} holds other RoPE frequencies than rope_theta="
                f"{config.rope_theta} and the rope scaling of {CONFIG} give"
            )
        return
    raise ValueError(f"{directory}: the checkpoint has a tensor the GPT has no place for: {name}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path.parent}: no {path.name}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from e


# ------------------------------------------------------------------------------- save

# The modules a plain GPT is made of; save_hf refuses any other (a LoRALinear, a sharded
# module) rather than write its parts under names HF would misread.
_PLAIN = (
    GPT,
    Block,
    rl.Attention,
    nnx.List,
    rl.Linear,
    rl.RMSNorm,
    rl.Embedding,
    rl.TiedProjection,
    rl.GatedMLP,
)


def save_hf(
    model: GPT,
    directory: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    eos_token_id: int | None = None,
) -> None:
    """Writes ``model`` as a Hugging Face checkpoint that ``from_pretrained`` loads.

    ``config.json`` (``config_to_hf``), ``model.safetensors`` with transformers' tensor names
    (each parameter in its storage dtype; a fused ``qkv`` split into q/k/v; a tied head not
    written, as transformers leaves it out) and, given ``tokenizer``, a copy of that
    ``tokenizer.json``. Existing files of those names are replaced.

    Args:
      model: a dense ``GPT`` of plain layers: LoRA adapters folded in first
        (``rudax.layers.merge_lora``), not a ``shard``ed model.
      directory: where to write; created if need be.
      tokenizer: a ``tokenizer.json`` to copy beside the weights, or None.
      eos_token_id: the tokenizer's end-of-text id for ``config.json``, or None.

    Example:
      >>> import os, tempfile
      >>> from flax import nnx
      >>> from examples.lm.hf import save_hf
      >>> from examples.lm.model import GPT, GPTConfig
      >>> config = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=1, n_heads=2)
      >>> directory = tempfile.mkdtemp()
      >>> save_hf(GPT(config, rngs=nnx.Rngs(0)), directory)
      >>> sorted(os.listdir(directory))
      ['config.json', 'model.safetensors']
    """
    if not isinstance(model, GPT):
        raise TypeError(f"model must be an examples.lm.model.GPT, got {type(model).__name__}")
    hf = config_to_hf(model.config, eos_token_id=eos_token_id)
    odd = [
        (path, node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Module) and not isinstance(node, _PLAIN)
    ]
    if odd:
        path, node = min(odd, key=lambda item: len(item[0]))
        raise TypeError(
            f"save_hf: {_where(path)} is a {type(node).__name__}, which has no Hugging Face "
            "form; fold LoRA adapters into the base with rudax.layers.merge_lora(model) first "
            "(save them alone with rudax.layers.save_adapter), and save the unsharded model"
        )
    tensors = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = np.asarray(var.get_value())
        if path[-2] == "qkv":  # the fused projection: HF's q, k, v are its column blocks
            c = model.config
            q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
            parts = np.split(value, [q, q + kv], axis=-1)
            for proj, part in zip(("q", "k", "v"), parts, strict=True):
                name, transposed = _tensor_name((*path[:-2], proj, path[-1]))
                tensors[name] = np.ascontiguousarray(part.T if transposed else part)
        else:
            name, transposed = _tensor_name(path)
            tensors[name] = np.ascontiguousarray(value.T if transposed else value)
    directory = Path(directory)
    if (directory / INDEX).exists():
        raise ValueError(
            f"{directory} holds a sharded checkpoint ({INDEX}), which readers would take "
            f"instead of the {WEIGHTS} written now: remove it, or save elsewhere"
        )
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise ValueError(f"tokenizer={str(tokenizer)!r} is not a file")
    directory.mkdir(parents=True, exist_ok=True)
    # Written beside and renamed: an interrupted save leaves no half file under the real name.
    partial = directory / (WEIGHTS + ".partial")
    save_file(tensors, partial, metadata={"format": "pt"})
    os.replace(partial, directory / WEIGHTS)
    (directory / CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
    if tokenizer is not None:
        (directory / TOKENIZER).write_bytes(Path(tokenizer).read_bytes())


# ------------------------------------------------------------------------------- export


def export(run_dir: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, Any]:
    """A training run's latest checkpoint weights and tokenizer, written by ``save_hf``.

    The run is only read: its ``config.json`` gives the model (``examples.lm.step``'s
    ``model_config``), its data directory the vocabulary, the end-of-text id and
    ``tokenizer.json`` (``examples.lm.prepare``), its latest checkpoint the weights (the
    model part only, as ``train --init-from`` reads it). A run trained with FSDP stores its
    parameters sharded; they are read back onto one device and written whole. A relative
    ``--data-dir`` is taken from the current directory, as training took it.

    Args:
      run_dir: ``runs/<name>``, a directory ``examples.lm.train`` wrote.
      out_dir: where ``save_hf`` writes.

    Returns:
      ``{"out_dir", "step", "config"}``: the output directory, the checkpoint's update and
      the GPTConfig.

    Raises:
      UsageError: the run, its checkpoints or its data directory are missing or unusable.
    """
    # Imported here: the trainer and its imports (tqdm, the data pipeline) only for the CLI.
    from examples.lm import train
    from examples.lm.prepare import read_prepared
    from examples.lm.step import model_config

    run_dir = Path(run_dir)
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except FileNotFoundError:
        raise UsageError(f"{run_dir} holds no run (no config.json)") from None
    args = argparse.Namespace(**saved)
    data_dir = Path(args.data_dir or train._default_data_dir(args.data))
    try:
        meta = read_prepared(data_dir)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"the run's data directory {data_dir}: {e}") from e
    tokenizer = data_dir / TOKENIZER
    if not tokenizer.is_file():
        raise UsageError(f"the run's data directory {data_dir} has no {TOKENIZER}")
    config = model_config(args, meta["vocab_size"])
    config_to_hf(config)  # an MoE run has no HF form: say so before reading anything
    root = run_dir / "checkpoints"
    if not root.is_dir():
        raise UsageError(f"{run_dir} has no checkpoints/ directory")
    model = train.create_model(config, args.seed)  # the structure; every weight is replaced
    template: Any = model
    if "fsdp" in (args.mesh or {}):
        # The checkpoint holds FSDP's flat shards; a one-device context reads them whole.
        one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
        template = shard(model, rs.ShardingContext(one, "fsdp"), compute_dtype=jnp.float32)
    graphdef, params, rest = nnx.split(template, nnx.Param, ...)
    checkpointer = rc.Checkpointer(root, read_only=True)  # the run is never written
    like = rc.TrainingRecord(model=params, optimizer=None, accumulator=None, state=None)
    try:
        step = checkpointer.latest_step()
        if step is None:
            raise UsageError(f"{root} holds no committed checkpoint")
        # strict=False: the model part only, whatever optimizer the run trained with.
        restored = checkpointer.restore(like, step=step, strict=False).model
    except ValueError as e:
        raise UsageError(f"{root}: checkpoint {step}: {e}") from e
    finally:
        checkpointer.close()
    restored_model = nnx.merge(graphdef, restored, rest)
    if template is not model:
        _unshard_into(model, restored_model)
    else:
        model = restored_model
    save_hf(model, out_dir, tokenizer=tokenizer, eos_token_id=meta.get("eot_id"))
    return {"out_dir": str(out_dir), "step": step, "config": config}


def _unshard_into(model: GPT, sharded: GPT) -> None:
    """Sets each of model's parameters to the whole value of sharded's ShardedParameter."""
    full = {}
    for prefix, node in nnx.iter_graph(sharded):
        if isinstance(node, rs.ShardedModule):
            for path, var in zip(node.paths, node.variables, strict=True):
                full[(*prefix, *path)] = var.get_value().unshard()
    for path, var in nnx.to_flat_state(nnx.state(model)):
        var.set_value(jnp.asarray(full[path], var.get_value().dtype))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m examples.lm.hf",
        description="Hugging Face Llama-format checkpoints out of examples.lm runs.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser(
        "export",
        help="write a run's latest weights and tokenizer as a Hugging Face checkpoint",
        description="Writes RUN_DIR's latest checkpoint weights and its tokenizer.json into "
        "OUT_DIR as config.json + model.safetensors + tokenizer.json, which "
        "transformers.AutoModelForCausalLM.from_pretrained loads. The run is only read.",
    )
    e.add_argument("run_dir", help="the run directory, e.g. runs/<name>")
    e.add_argument("out_dir", help="the directory to write (created if need be)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The CLI; a bad run directory ends in argparse's ``error:`` line and exit code 2."""
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        with jax.numpy_dtype_promotion("strict"):
            result = export(args.run_dir, args.out_dir)
    except (UsageError, ValueError) as e:
        parser.error(str(e))
    c = result["config"]
    print(
        f"exported {args.run_dir} (update {result['step']}, a {c.n_layers}x{c.d_model} GPT, "
        f"vocabulary {c.vocab_size}) to {args.out_dir}"
    )
    return result


if __name__ == "__main__":
    main()
