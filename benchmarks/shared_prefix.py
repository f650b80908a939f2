"""Shared-prefix post-training: one prompt, many continuations, measured in one run.

One section per part of the work, each a subcommand:

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
import json
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks._timing import alternate, ratio_summary
from rudax.models import LlamaConfig, LlamaForCausalLM, generate
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


# --- the command ---------------------------------------------------------------------------

# Each section adds its subcommand, whose ``run(args)`` returns (results, printed table).
SECTIONS = [_sampling_section]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results to this file")
    sections = p.add_subparsers(dest="section", required=True)
    for add in SECTIONS:
        add(sections)
    args = p.parse_args(argv)
    r, table = args.run(args)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return r


if __name__ == "__main__":
    main()
