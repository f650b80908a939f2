"""A random Llama checkpoint of any size, written tensor by tensor: a base to measure with.

    python -m benchmarks.random_llama OUT_DIR --hidden-size 1024 --layers 12   # ~200M

Streamed preparation must be measured on a checkpoint much larger than the test models, and
none may be downloaded. This writes what ``save_pretrained`` writes for a
``LlamaForCausalLM`` (``config.json``, safetensors shards and their
``model.safetensors.index.json``) with N(0, 0.02) weights and unit norms, one tensor at a
time, so making a 400 MB checkpoint never holds more than one shard's tensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from rudax.models import LlamaConfig

CONFIG, INDEX = "config.json", "model.safetensors.index.json"

# Tensors per shard file, at most this many bytes (transformers' own default is 5 GB).
_SHARD_BYTES = 100 * 2**20


def _tensors(c: LlamaConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor of a Llama with config c, in HF's order."""
    assert c.num_key_value_heads is not None and c.head_dim is not None  # filled when built
    d, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    hidden = c.intermediate_size
    yield "model.embed_tokens.weight", (c.vocab_size, d)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (d,)
        yield f"{p}.self_attn.q_proj.weight", (q, d)
        yield f"{p}.self_attn.k_proj.weight", (kv, d)
        yield f"{p}.self_attn.v_proj.weight", (kv, d)
        yield f"{p}.self_attn.o_proj.weight", (d, q)
        yield f"{p}.post_attention_layernorm.weight", (d,)
        yield f"{p}.mlp.gate_proj.weight", (hidden, d)
        yield f"{p}.mlp.up_proj.weight", (hidden, d)
        yield f"{p}.mlp.down_proj.weight", (d, hidden)
    yield "model.norm.weight", (d,)
    if not c.tie_word_embeddings:
        yield "lm_head.weight", (c.vocab_size, d)


def llama_config(
    *,
    vocab_size: int,
    hidden_size: int,
    layers: int,
    heads: int,
    kv_heads: int,
    seq_len: int = 2048,
    intermediate_size: int | None = None,
) -> LlamaConfig:
    """An untied Llama of these sizes; the MLP SwiGLU's ``8/3 * hidden_size`` rounded up to a
    multiple of 64 unless given (the parameter count of a 4x GELU MLP)."""
    if intermediate_size is None:
        intermediate_size = math.ceil(8 * hidden_size / 3 / 64) * 64
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq_len,
    )


def parameters(config: LlamaConfig) -> int:
    """The checkpoint's parameter count."""
    return sum(int(np.prod(shape)) for _, shape in _tensors(config))


def write_random_llama(
    out_dir: str | os.PathLike, config: LlamaConfig, *, seed: int = 0
) -> dict[str, Any]:
    """Writes a random ``LlamaForCausalLM`` checkpoint of ``config`` in bf16 under out_dir.

    Args:
      out_dir: the folder (created if need be).
      config: a ``rudax.models.LlamaConfig`` without biases (its ``param_dtype`` is not
        used: the files are bf16).
      seed: the weights' seed.

    Returns:
      ``{"parameters": n, "bytes": n * 2, "largest_tensor_bytes": ..., "files": [...]}``.

    Example:
      >>> import tempfile
      >>> from benchmarks.random_llama import write_random_llama
      >>> from rudax.models import LlamaConfig
      >>> c = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=192,
      ...                 num_hidden_layers=1, num_attention_heads=2)
      >>> write_random_llama(tempfile.mkdtemp(), c)["parameters"]
      61632
    """
    if config.qkv_bias or config.o_bias or config.mlp_bias:
        raise ValueError("write_random_llama writes a Llama without biases")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = dataclasses.replace(config, param_dtype="bfloat16").to_hf()
    (out / CONFIG).write_text(json.dumps(hf, indent=1) + "\n")
    rng = np.random.default_rng(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, np.ndarray] = {}
    shard_bytes, files, largest = 0, [], 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        files.append(name)
        shard, shard_bytes = {}, 0

    for name, shape in _tensors(config):
        if name.endswith("norm.weight"):
            tensor = np.ones(shape, ml_dtypes.bfloat16)
        else:
            tensor = (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        largest = max(largest, tensor.nbytes)
        if shard and shard_bytes + tensor.nbytes > _SHARD_BYTES:
            flush()
        shard[name] = tensor
        shard_bytes += tensor.nbytes
    flush()
    n = parameters(config)
    index = {"metadata": {"total_size": 2 * n}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return {"parameters": n, "bytes": 2 * n, "largest_tensor_bytes": largest, "files": files}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.random_llama",
        description="Writes a random bf16 Llama checkpoint (config.json + safetensors shards).",
    )
    p.add_argument("out_dir")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--intermediate-size", type=int, help="default: SwiGLU's 8/3, to 64")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    config = llama_config(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        seq_len=args.seq_len,
        intermediate_size=args.intermediate_size,
    )
    info = write_random_llama(args.out_dir, config, seed=args.seed)
    print(f"{args.out_dir}: {info['parameters']:,} parameters in {len(info['files'])} files")
    return info


if __name__ == "__main__":
    main()
