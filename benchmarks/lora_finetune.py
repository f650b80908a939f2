"""LoRA fine-tuning of a Hugging Face Llama: rudax against transformers + peft, the same step.

    python -m benchmarks.lora_finetune                 # the examples' small size, 4 rounds
    python -m benchmarks.lora_finetune --rounds 6 --steps 12 --batch 8

One tiny random ``LlamaForCausalLM`` is made with transformers and saved with
``save_pretrained`` (nothing downloaded). Each round runs both arms, each in a fresh child
process, in alternating order:

* ``rudax``: ``rudax.models.from_pretrained`` of that directory, ``rudax.layers.apply_lora`` on
  the same targets with the same rank and alpha (the model's module paths are Hugging Face's
  names, as peft matches them), and a ``jax.jit`` step (``rudax.models.causal_lm_loss_sum``,
  the chunked ``linear_cross_entropy`` loss, ``jax.grad`` over the adapter parameters only,
  ``rudax.optim.adamw``) with its buffers donated;
* ``torch``: ``transformers.AutoModelForCausalLM.from_pretrained`` of the same directory,
  ``peft.get_peft_model`` with the same ``LoraConfig``, the model's own loss
  (``labels=input_ids``), ``loss.backward()`` and ``torch.optim.AdamW`` over the trainable
  parameters, eager, on the same number of CPU threads.

Both children start with glibc's ``MALLOC_*`` settings of ``rudax.run.retain_freed_memory``
(freed memory kept for reuse: faster steps, a higher peak), or with the default malloc under
``--system-malloc``.

Both train in fp32 on the same token ids: ``B`` sequences of ``T + 1`` tokens, ``B * T``
predicted tokens per step (the first step's loss, the base model's since B starts at zero,
is printed for both, to show they compute the same function). A child times ``--steps``
steps after two untimed ones (the first compiles) and reports tokens per second and its
peak resident memory (``ru_maxrss``: the libraries, the model, the compiled program or the
autograd graph, everything the process ever held). The table gives each arm's median and
the per-round ratio rudax/torch with its spread.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Both children keep the memory they free, as the examples' trainer does for itself: XLA:CPU's
# step scratch and torch's autograd buffers are reused instead of faulted in every step.
from rudax.run import MALLOC_ENV

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("rudax", "torch")


def _make_model(directory: Path, args: argparse.Namespace) -> None:
    """A random LlamaForCausalLM of the examples' small size, saved in fp32."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        intermediate_size=args.mlp_hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def _batch(args: argparse.Namespace):
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, args.vocab, size=(args.batch, args.seq + 1), dtype=np.int64)


def _time_steps(step, steps: int) -> tuple[float, float]:
    """(seconds per step over ``steps`` steps after two untimed ones, the first step's loss)."""
    first = step()
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps, first


def _rudax_child(directory: Path, args: argparse.Namespace) -> tuple[float, float]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import rudax.layers as rl
    import rudax.models as rm
    import rudax.optim as ro

    model = rm.from_pretrained(directory, param_dtype=jnp.float32, dtype=jnp.float32)
    rl.apply_lora(model, args.targets, rank=args.rank, alpha=args.alpha, rngs=nnx.Rngs(0))
    graphdef, adapters, rest = nnx.split(model, rl.LoRAParam, ...)
    tx = ro.adamw(args.lr)
    opt_state = tx.init(adapters)

    def mean_loss(adapters, rest, batch):
        # every next token counts, as transformers' labels=input_ids
        batch = {"tokens": batch[:, :-1], "labels": batch[:, 1:]}
        total, metrics = rm.causal_lm_loss_sum(nnx.merge(graphdef, adapters, rest), batch)
        return total / metrics["tokens"]

    def step(adapters, opt_state, rest, batch):
        loss, grads = jax.value_and_grad(mean_loss)(adapters, rest, batch)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1))
    batch = jnp.asarray(_batch(args), jnp.int32)
    held = [adapters, opt_state]

    def run():
        held[0], held[1], loss = step(held[0], held[1], rest, batch)
        return float(loss)  # waits for the step

    return _time_steps(run, args.steps)


def _torch_child(directory: Path, args: argparse.Namespace) -> tuple[float, float]:
    import peft
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    config = peft.LoraConfig(
        r=args.rank, lora_alpha=args.alpha, target_modules=list(args.targets), lora_dropout=0.0
    )
    model = peft.get_peft_model(model, config)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    ids = torch.from_numpy(_batch(args))

    def run():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return _time_steps(run, args.steps)


def _child(arm: str, directory: Path, args: argparse.Namespace) -> dict[str, float]:
    seconds, first_loss = (_rudax_child if arm == "rudax" else _torch_child)(directory, args)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "tokens_per_s": args.batch * args.seq / seconds,
        "peak_mib": peak_kib / 1024,
        "first_loss": first_loss,
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds")
    p.add_argument("--steps", type=int, default=8, help="timed steps per arm per round")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--mlp-hidden", type=int, default=704)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--targets", type=lambda s: s.split(","), default=["q_proj", "v_proj"])
    p.add_argument(
        "--system-malloc",
        action="store_true",
        help="run both children with glibc's default malloc (lower peak memory, slower steps)",
    )
    p.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    return p


def _run_child(arm: str, directory: Path, argv: list[str]) -> dict[str, float]:
    child = ["--child", arm, "--model-dir", str(directory)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.lora_finetune", *argv, *child],
        cwd=ROOT,
        env=dict(os.environ, **({} if "--system-malloc" in argv else MALLOC_ENV)),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the {arm} child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.model_dir, args)))
        return
    if args.rounds < 1 or args.steps < 1:
        _parser().error("--rounds and --steps must be >= 1")
    directory = Path(tempfile.mkdtemp(prefix="rudax-lora-bench-"))
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    try:
        _make_model(directory, args)
        for r in range(args.rounds):
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                results[arm].append(_run_child(arm, directory, argv))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        shutil.rmtree(directory)

    print(
        f"\nLoRA r={args.rank} alpha={args.alpha:g} on {','.join(args.targets)}: Llama "
        f"{args.layers}x{args.d_model} ({args.heads} heads, {args.kv_heads} kv), vocab "
        f"{args.vocab}, batch {args.batch}x{args.seq}, fp32, {os.cpu_count()} CPU threads; "
        f"{args.rounds} alternating rounds, a fresh process per arm per round"
    )
    # B starts at zero in both, so the first step's loss is the base model's on the batch:
    # the two arms compute the same function.
    losses = {arm: results[arm][0]["first_loss"] for arm in ARMS}
    print(f"first step's loss: rudax {losses['rudax']:.6f}, torch {losses['torch']:.6f}")
    print(f"{'':<22} {'rudax':>10} {'torch+peft':>11}   rudax/torch: median [min, max]")
    for key, label in (("tokens_per_s", "tokens/s"), ("peak_mib", "peak host MiB")):
        a = [x[key] for x in results["rudax"]]
        b = [x[key] for x in results["torch"]]
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        print(
            f"{label:<22} {statistics.median(a):>10,.0f} {statistics.median(b):>11,.0f}"
            f"   {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
        )


if __name__ == "__main__":
    main()
