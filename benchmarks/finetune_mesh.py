"""The fine-tuner's step on one device, plain and through the mesh path at ``fsdp=1``.

    python -m benchmarks.finetune_mesh                         # CPU or the machine's GPU
    python -m benchmarks.finetune_mesh --rounds 5 --json out.json

``examples.finetune`` runs ``rudax.sharding.make_train_steps``: without ``--mesh`` on one
device; with ``--mesh fsdp=1`` over the mesh: the same model sharded over a
one-device ``fsdp`` axis (``rudax.models.shard``: every weight a flat ``ShardedParameter``,
gathered inside ``jax.shard_map``), the step in ``shard_map``. On one device the gathers and
reduce-scatters are copies at most; this measures what the sharded path costs where it
buys nothing. The model is a QLoRA Llama (``LlamaConfig.tiny`` at ``--hidden`` width and
``--layers`` layers, every projection NF4, rank-8 adapters on all of them, dropout 0) on
random tokens; one step is a microbatch's gradient and the AdamW update. The arms
alternate round by round; the table gives the median step time of each and the ratio's
median [min, max]. The losses of the two arms' first step are printed too (they should agree
to fp32 rounding).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

import rudax.layers as rl
import rudax.models as rm
import rudax.optim as ro
import rudax.sharding as rs
from benchmarks._timing import alternate, ratio_summary


def _model(hidden: int, layers: int, vocab: int) -> rm.LlamaForCausalLM:
    config = rm.LlamaConfig.tiny(
        vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64
    )
    model = rm.LlamaForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rl.apply_lora(
        model,
        list(rm.PROJECTIONS),
        rank=8,
        alpha=16.0,
        quantize_base="nf4",
        quantize_untargeted=True,
        rngs=nnx.Rngs(1),
    )
    return model


def _batch(rows: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(0).integers(0, vocab, (rows, seq), dtype=np.int32)
    return {
        "tokens": tokens,
        "labels": tokens,
        "segment_ids": np.ones((rows, seq), np.int32),
        "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy(),
    }


def _arm(model: rm.LlamaForCausalLM, mesh: Mesh | None, batch: dict[str, np.ndarray]) -> Any:
    """A step closure on its own copy of the state, and its first loss sum."""
    trained = nnx.clone(model)
    if mesh is not None:  # FSDP over the one-device fsdp axis, as examples.finetune holds it
        trained = rm.shard(trained, rs.ShardingContext(mesh, "fsdp"))
    trained.eval()
    eval_def = nnx.graphdef(trained)
    trained.train()
    graphdef, adapters, rngs, base = nnx.split(trained, rl.LoRAParam, nnx.RngState, ...)
    tx = optax.chain(ro.clip_by_global_norm(1.0), ro.adamw(1e-3, weight_decay=0.0))
    opt_state = tx.init(adapters)
    acc = ro.GradientAccumulator.init(adapters, jnp.float32)
    steps = rs.make_train_steps(
        graphdef, tx, rm.causal_lm_loss_sum, mesh=mesh, eval_graphdef=eval_def
    )
    micro, apply = steps.micro, steps.apply
    if mesh is None:
        placed = batch
    else:
        adapters, rngs, base, opt_state, acc = rs.place(
            (adapters, rngs, base, opt_state, acc), mesh
        )
        placed = rs.put_batch(batch, mesh, len(batch["tokens"]))
    state = {"adapters": adapters, "rngs": rngs, "opt": opt_state, "acc": acc}

    def step() -> Any:
        acc, state["rngs"], m = micro(state["adapters"], state["rngs"], state["acc"], base, placed)
        state["adapters"], state["opt"], state["acc"], _ = apply(
            state["adapters"], state["opt"], acc
        )
        return m["ce_sum"]

    first = float(step())
    return step, first


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.finetune_mesh")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    mesh = Mesh(np.array([device]), ("fsdp",))
    model = _model(args.hidden, args.layers, args.vocab)
    batch = _batch(args.rows, args.seq, args.vocab)
    one, loss_one = _arm(model, None, batch)
    sharded, loss_sharded = _arm(model, mesh, batch)
    times = alternate(
        {"one device": one, "mesh fsdp=1": sharded}, rounds=args.rounds, iters=args.iters
    )
    med, lo, hi = ratio_summary(times["mesh fsdp=1"], times["one device"])
    tokens = args.rows * args.seq
    rows = [
        f"fine-tuner step on {device.platform} ({device.device_kind}): QLoRA Llama "
        f"{args.layers}x{args.hidden}, vocab {args.vocab}, {args.rows}x{args.seq} tokens",
        "| arm | median ms/step | tokens/s | first loss sum |",
        "|---|---|---|---|",
    ]
    for name, first in (("one device", loss_one), ("mesh fsdp=1", loss_sharded)):
        t = float(np.median(times[name]))
        rows.append(f"| {name} | {t * 1e3:.1f} | {tokens / t:,.0f} | {first:.6f} |")
    rows.append(f"mesh fsdp=1 / one device: {med:.3f} [{lo:.3f}, {hi:.3f}]")
    print("\n".join(rows))
    result = {
        "platform": device.platform,
        "times_s": times,
        "ratio": [med, lo, hi],
        "first_loss_sum": {"one device": loss_one, "mesh fsdp=1": loss_sharded},
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
