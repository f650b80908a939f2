"""Shared-prefix post-training: one prompt, many continuations, measured in one run.

One section per part of the work, each a subcommand:

* ``training``: forward + backward of the decoder layers (the gradient of ``sum(h * w)``, a
  fixed random ``w``; no head, no loss: the layers are what sharing changes) over one
  prompt and its G completions: one shared row (``pack_shared_prefix``, ``branch_ids``) against
  the G rows ``prompt + completion`` a trainer runs without sharing. Per arm: tokens, XLA's
  temp bytes of the compiled step, median seconds; speed: the unshared time / the shared one
  per round, median [min, max]. Before timing, every completion token's hidden state must
  agree between the arms (the largest difference is printed).

    python -m benchmarks.shared_prefix training                 # 2 layers, 1024 + 8 x 128

* ``sampling``: G continuations of one prompt by ``rudax.models.generate(num_samples=G)``
  (the prompt prefilled once, its keys and values stored once and read once per step for all
  G samples) against the same prompt repeated G times (``num_samples=1``: G prefills, G copies
  of its keys and values). A random model of SmolLM-135M's shape, fp32 on the CPU, sampling
  at temperature 1. Per arm: a 1-token call (the prefill and one sampling step) and an
  N-token call, the four alternated round by round (``benchmarks/_timing.py``):

  - tokens/s: G * N new tokens / the N-token call's median time (prefill included);
  - prefill s: the 1-token call; decode tokens/s: G * (N - 1) / (N-token - 1-token time);
  - KV cache bytes: the keys and values the prefill leaves (``KVCache.nbytes``);
  - speed: the repeated prompt's time / the shared prompt's, per round, median [min, max].

  Before timing, both arms decode greedily and must give the same G rows.

    python -m benchmarks.shared_prefix sampling                 # 30 layers, 512 + 64, G=8
    python -m benchmarks.shared_prefix --json out.json sampling --layers 8 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks._sections import run_sections
from benchmarks._timing import alternate, ratio_summary
from rudax.models import IGNORE_INDEX, LlamaConfig, LlamaForCausalLM, generate, pack_shared_prefix
from rudax.models._generate import _cache_shapes

# SmolLM-135M's shape (HuggingFaceTB/SmolLM-135M config.json), random weights.
PRESETS = {
    "smollm-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}


# --- sampling ------------------------------------------------------------------------------


def build(preset: str, layers: int | None) -> LlamaForCausalLM:
    """The preset's random model in fp32, with ``layers`` decoder layers if given."""
    fields = dict(PRESETS[preset])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return LlamaForCausalLM(LlamaConfig(**fields, param_dtype=jnp.float32), rngs=nnx.Rngs(0))


def sampling(
    preset: str, layers: int | None, samples: int, prompt_len: int, new_tokens: int, rounds: int
) -> dict[str, Any]:
    model = build(preset, layers)
    config = model.config
    prompt = np.random.default_rng(0).integers(1, config.vocab_size, prompt_len).tolist()
    arms: dict[str, tuple[list[list[int]], int]] = {
        "shared": ([prompt], samples),  # one prompt, G samples sharing its keys and values
        "repeated": ([prompt] * samples, 1),  # G copies of the prompt, one sample each
    }

    def call(arm: str, n: int, **kw: Any) -> Callable[[], list[list[int]]]:
        prompts, g = arms[arm]
        return lambda: generate(model, prompts, n, num_samples=g, stop_tokens=[], **kw)

    same = call("shared", new_tokens)() == call("repeated", new_tokens)()  # greedy
    key = jax.random.key(0)
    timed = {
        f"{arm} {n}": call(arm, n, temperature=1.0, rng=key)
        for arm in arms
        for n in (1, new_tokens)
    }
    times = alternate(timed, rounds=rounds, iters=1)
    rows = {}
    for arm, (prompts, g) in arms.items():
        one, many = times[f"{arm} 1"], times[f"{arm} {new_tokens}"]
        decode = [m - o for m, o in zip(many, one, strict=True)]
        rows[arm] = {
            "tokens_per_s": samples * new_tokens / statistics.median(many),
            "prefill_s": statistics.median(one),
            "decode_tokens_per_s": samples * (new_tokens - 1) / statistics.median(decode),
            "kv_cache_bytes": _cache_shapes(model, prompts, new_tokens, num_samples=g).nbytes,
            "times_s": many,
            "prefill_times_s": one,
            "decode_times_s": decode,
        }
    speed = {
        "total": ratio_summary(rows["repeated"]["times_s"], rows["shared"]["times_s"]),
        "prefill": ratio_summary(
            rows["repeated"]["prefill_times_s"], rows["shared"]["prefill_times_s"]
        ),
        "decode": ratio_summary(
            rows["repeated"]["decode_times_s"], rows["shared"]["decode_times_s"]
        ),
    }
    return {
        "preset": preset,
        "layers": config.num_hidden_layers,
        "samples": samples,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "device": jax.devices()[0].device_kind,
        "greedy_outputs_equal": same,
        "arms": rows,
        "speed_shared_vs_repeated": speed,
        "kv_cache_ratio": rows["repeated"]["kv_cache_bytes"] / rows["shared"]["kv_cache_bytes"],
    }


def sampling_report(r: dict[str, Any]) -> str:
    lines = [
        f"sampling, {r['preset']} shape, {r['layers']} layers, fp32, {r['device']}: "
        f"{r['samples']} samples of a {r['prompt_len']}-token prompt, {r['new_tokens']} new "
        f"tokens each, temperature 1, {r['rounds']} rounds; greedy outputs equal: "
        f"{r['greedy_outputs_equal']}",
        "",
        "| arm | tokens/s | prefill s | decode tokens/s | KV cache MiB |",
        "|---|---|---|---|---|",
    ]
    names = {
        "shared": f"shared prompt (num_samples={r['samples']})",
        "repeated": f"prompt repeated {r['samples']}x (num_samples=1)",
    }
    for arm, row in r["arms"].items():
        lines.append(
            f"| {names[arm]} | {row['tokens_per_s']:,.1f} | {row['prefill_s']:.3f} | "
            f"{row['decode_tokens_per_s']:,.1f} | {row['kv_cache_bytes'] / 2**20:,.2f} |"
        )
    lines.append("")
    for what, (med, lo, hi) in r["speed_shared_vs_repeated"].items():
        lines.append(f"{what}: shared {med:.2f}x the repeated prompt's speed [{lo:.2f}, {hi:.2f}]")
    lines.append(f"KV cache: shared {r['kv_cache_ratio']:.2f}x smaller")
    return "\n".join(lines)


def _sampling_section(sections: Any) -> None:
    s = sections.add_parser("sampling", help="generate(num_samples=G) against G prompt copies")
    s.add_argument("--preset", choices=sorted(PRESETS), default="smollm-135m")
    s.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    s.add_argument("--samples", type=int, default=8)
    s.add_argument("--prompt-len", type=int, default=512)
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--rounds", type=int, default=3)

    def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
        r = sampling(
            args.preset, args.layers, args.samples, args.prompt_len, args.new_tokens, args.rounds
        )
        return r, sampling_report(r)

    s.set_defaults(run=run)


# --- training ------------------------------------------------------------------------------


def training(
    preset: str, layers: int, samples: int, prompt_len: int, completion_len: int, rounds: int
) -> dict[str, Any]:
    model = build(preset, layers)
    config = model.config
    rng = np.random.default_rng(0)
    draw = lambda n: rng.integers(1, config.vocab_size, n).tolist()
    prompt = draw(prompt_len)
    completions = [draw(completion_len) for _ in range(samples)]
    rows = pack_shared_prefix([(prompt, completions)])
    batches = {
        "shared": {
            "tokens": rows.tokens,
            "branch_ids": rows.branch_ids,
            "positions": rows.positions,
        },
        # without sharing: G rows of prompt + completion
        "unshared": {"tokens": np.asarray([prompt + c for c in completions], np.int32)},
    }
    batches = {arm: {k: jnp.asarray(v) for k, v in b.items()} for arm, b in batches.items()}
    graphdef, params = nnx.split(model, nnx.Param)
    width = max(b["tokens"].shape[1] for b in batches.values())
    w = jax.random.normal(jax.random.key(1), (1, width, config.hidden_size), jnp.float32)

    def hidden(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        inputs = dict(batch)
        return nnx.merge(graphdef, params).hidden_states(inputs.pop("tokens"), **inputs)[0]

    @jax.jit
    def step(params: Any, batch: dict[str, jax.Array]) -> Any:
        t = batch["tokens"].shape[1]
        return jax.grad(lambda p: jnp.sum(hidden(p, batch).astype(jnp.float32) * w[:, :t]))(params)

    # Each completion token's hidden state, in both layouts (the same tokens in the same order).
    shared_h = np.asarray(jax.jit(hidden)(params, batches["shared"]))
    shared_h = shared_h[rows.labels != IGNORE_INDEX]
    unshared_h = np.asarray(jax.jit(hidden)(params, batches["unshared"]))[:, prompt_len - 1 : -1]
    unshared_h = unshared_h.reshape(shared_h.shape)
    diff = float(np.abs(shared_h - unshared_h).max() / np.abs(unshared_h).max())

    arms, stats = {}, {}
    for arm, batch in batches.items():
        compiled = step.lower(params, batch).compile()
        memory = compiled.memory_analysis()
        stats[arm] = {
            "tokens": int(batch["tokens"].size),
            "temp_bytes": None if memory is None else int(memory.temp_size_in_bytes),
        }
        arms[arm] = lambda c=compiled, b=batch: c(params, b)
    times = alternate(arms, rounds=rounds, iters=1)
    for arm in arms:
        stats[arm]["seconds"] = statistics.median(times[arm])
        stats[arm]["times_s"] = times[arm]
    return {
        "preset": preset,
        "layers": config.num_hidden_layers,
        "samples": samples,
        "prompt_len": prompt_len,
        "completion_len": completion_len,
        "rounds": rounds,
        "device": jax.devices()[0].device_kind,
        "max_relative_difference": diff,
        "arms": stats,
        "speed_shared_vs_unshared": ratio_summary(times["unshared"], times["shared"]),
    }


def training_report(r: dict[str, Any]) -> str:
    lines = [
        f"training (forward + backward of the layers), {r['preset']} shape, {r['layers']} "
        f"layers, fp32, {r['device']}: a {r['prompt_len']}-token prompt and {r['samples']} "
        f"completions of {r['completion_len']}, {r['rounds']} rounds; completion hidden states "
        f"agree within {r['max_relative_difference']:.1e} of the largest",
        "",
    ]
    names = {"shared": "shared row (branch_ids)", "unshared": f"{r['samples']} rows, unshared"}
    return "\n".join(lines + step_table(r["arms"], names, r["speed_shared_vs_unshared"]))


def step_table(
    arms: dict[str, dict[str, Any]], names: dict[str, str], speed: Sequence[float]
) -> list[str]:
    """The lines of a table of training steps, one row per arm (its tokens, XLA temp bytes
    and median seconds), then the shared layout's speed, median [min, max]."""
    lines = ["| arm | tokens | XLA temp MiB | s per step |", "|---|---|---|---|"]
    for arm, row in arms.items():
        temp = "n/a" if row["temp_bytes"] is None else f"{row['temp_bytes'] / 2**20:,.1f}"
        lines.append(f"| {names[arm]} | {row['tokens']:,} | {temp} | {row['seconds']:.3f} |")
    med, lo, hi = speed
    return [*lines, "", f"speed: shared {med:.2f}x the unshared layout's [{lo:.2f}, {hi:.2f}]"]


def _training_section(sections: Any) -> None:
    s = sections.add_parser("training", help="forward + backward, shared row against G rows")
    s.add_argument("--preset", choices=sorted(PRESETS), default="smollm-135m")
    s.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    s.add_argument("--samples", type=int, default=8)
    s.add_argument("--prompt-len", type=int, default=1024)
    s.add_argument("--completion-len", type=int, default=128)
    s.add_argument("--rounds", type=int, default=3)

    def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
        r = training(
            args.preset, args.layers, args.samples, args.prompt_len, args.completion_len,
            args.rounds,
        )  # fmt: skip
        return r, training_report(r)

    s.set_defaults(run=run)


# --- the command ---------------------------------------------------------------------------

SECTIONS = [_training_section, _sampling_section]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run_sections(__doc__.split("\n\n")[0], SECTIONS, argv)


if __name__ == "__main__":
    main()
