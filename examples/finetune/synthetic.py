"""A random Llama checkpoint of any size, written tensor by tensor: a base to measure with.

    python -m examples.finetune.synthetic OUT_DIR --d-model 1024 --n-layers 12   # ~200M

Streamed preparation must be measured on a checkpoint much larger than the test models, and
none may be downloaded. This writes what ``save_pretrained`` writes for a
``LlamaForCausalLM`` (``config.json``, safetensors shards and their
``model.safetensors.index.json``) with N(0, 0.02) weights and unit norms, one tensor at a
time, so making a 400 MB checkpoint never holds more than one shard's tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from examples.lm.hf import INDEX
from examples.lm.hf_config import CONFIG, config_to_hf
from examples.lm.model import GPTConfig

# Tensors per shard file, at most this many bytes (transformers' own default is 5 GB).
_SHARD_BYTES = 100 * 2**20


def _tensors(c: GPTConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor of a dense Llama with config c, in HF's order."""
    d, kv = c.d_model, c.n_kv_heads * c.head_dim
    hidden = c.mlp_hidden
    yield "model.embed_tokens.weight", (c.vocab_size, d)
    for i in range(c.n_layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (d,)
        yield f"{p}.self_attn.q_proj.weight", (c.n_heads * c.head_dim, d)
        yield f"{p}.self_attn.k_proj.weight", (kv, d)
        yield f"{p}.self_attn.v_proj.weight", (kv, d)
        yield f"{p}.self_attn.o_proj.weight", (d, c.n_heads * c.head_dim)
        yield f"{p}.post_attention_layernorm.weight", (d,)
        yield f"{p}.mlp.gate_proj.weight", (hidden, d)
        yield f"{p}.mlp.up_proj.weight", (hidden, d)
        yield f"{p}.mlp.down_proj.weight", (d, hidden)
    yield "model.norm.weight", (d,)
    if not c.tie_embeddings:
        yield "lm_head.weight", (c.vocab_size, d)


def parameters(config: GPTConfig) -> int:
    """The checkpoint's parameter count."""
    return sum(int(np.prod(shape)) for _, shape in _tensors(config))


def write_random_llama(
    out_dir: str | os.PathLike, config: GPTConfig, *, seed: int = 0
) -> dict[str, Any]:
    """Writes a random ``LlamaForCausalLM`` checkpoint of ``config`` in bf16 under out_dir.

    Args:
      out_dir: the folder (created if need be).
      config: a dense ``GPTConfig`` without ``qkv_bias``.
      seed: the weights' seed.

    Returns:
      ``{"parameters": n, "bytes": n * 2, "largest_tensor_bytes": ..., "files": [...]}``.

    Example:
      >>> import tempfile
      >>> from examples.finetune.synthetic import write_random_llama
      >>> from examples.lm.model import GPTConfig
      >>> c = GPTConfig(vocab_size=64, seq_len=8, d_model=64, n_layers=1, n_heads=2)
      >>> write_random_llama(tempfile.mkdtemp(), c)["parameters"]
      57536
    """
    if config.qkv_bias or config.num_experts:
        raise ValueError("write_random_llama writes a dense Llama: no qkv_bias, no experts")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(config_to_hf(config), indent=1) + "\n")
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
        prog="python -m examples.finetune.synthetic",
        description="Writes a random bf16 Llama checkpoint (config.json + safetensors shards).",
    )
    p.add_argument("out_dir")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--n-kv-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    config = GPTConfig(
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        tie_embeddings=False,
        fused_qkv=False,
    )
    info = write_random_llama(args.out_dir, config, seed=args.seed)
    print(f"{args.out_dir}: {info['parameters']:,} parameters in {len(info['files'])} files")
    return info


if __name__ == "__main__":
    main()
