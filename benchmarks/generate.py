"""Generation speed: ``rudax.models.generate`` against transformers' ``generate``, one run.

The same tiny random Llama (transformers builds it; rudax reads its weights by name), the
same left-padded prompts, greedy decoding in fp32 on the CPU. Each arm generates 1 token
(the prefill, plus one sampling step) and ``--new-tokens`` tokens, alternating arm by arm
round by round (``benchmarks/_timing.py``):

* prefill tokens/s: prompt tokens / time of the 1-token call;
* decode tokens/s: the further tokens / (time of the long call - time of the 1-token call);
* speed: transformers' time / rudax's per round, median [min, max].

The outputs are checked equal token for token before anything is timed.

    python -m benchmarks.generate                  # hidden 256, 4 layers, B=4, 64 + 64
    python -m benchmarks.generate --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from benchmarks._timing import alternate, ratio_summary
from rudax.models import LlamaConfig, LlamaForCausalLM, generate
from rudax.models._hf_names import load_state

PRESETS = {
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, vocab_size=4096),
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=256),
}


def build(preset: str) -> tuple[Any, LlamaForCausalLM]:
    """A random transformers Llama and the rudax model holding the same weights."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **PRESETS[preset],
        num_attention_heads=8 if preset == "small" else 4,
        num_key_value_heads=4 if preset == "small" else 2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    ref = transformers.LlamaForCausalLM(config).eval()
    ours = LlamaForCausalLM(
        LlamaConfig.from_hf(config.to_dict(), param_dtype=jnp.float32), rngs=nnx.Rngs(0)
    )
    tensors = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    load_state(ours, tensors.__getitem__, set(tensors))
    return ref, ours


def run(preset: str, batch: int, prompt_len: int, new_tokens: int, rounds: int) -> dict[str, Any]:
    ref, ours = build(preset)
    vocab = ref.config.vocab_size
    rng = np.random.default_rng(0)
    # ragged prompts: the longest prompt_len, the others shorter, left-padded for transformers
    lengths = [prompt_len - 7 * i for i in range(batch)]
    prompts = [rng.integers(1, vocab, n).tolist() for n in lengths]
    ids = torch.zeros((batch, prompt_len), dtype=torch.long)
    mask = torch.zeros((batch, prompt_len), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, prompt_len - len(p) :] = torch.tensor(p)
        mask[i, prompt_len - len(p) :] = 1

    def theirs(n: int) -> list[list[int]]:
        with torch.no_grad():
            out = ref.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[:, prompt_len:].tolist()

    def mine(n: int) -> list[list[int]]:
        return generate(ours, prompts, n, stop_tokens=[])

    same = mine(new_tokens) == theirs(new_tokens)
    times = alternate(
        {
            "rudax 1": lambda: mine(1),
            "transformers 1": lambda: theirs(1),
            "rudax n": lambda: mine(new_tokens),
            "transformers n": lambda: theirs(new_tokens),
        },
        rounds=rounds,
        iters=1,
    )
    prompt_tokens = sum(lengths)
    rows = {}
    for arm in ("rudax", "transformers"):
        one, many = times[f"{arm} 1"], times[f"{arm} n"]
        decode = [m - o for m, o in zip(many, one, strict=True)]
        rows[arm] = {
            "prefill_tokens_per_s": prompt_tokens / statistics.median(one),
            "decode_tokens_per_s": batch * (new_tokens - 1) / statistics.median(decode),
            "prefill_s": one,
            "decode_s": decode,
        }
    speed_prefill = ratio_summary(times["transformers 1"], times["rudax 1"])
    speed_decode = ratio_summary(rows["transformers"]["decode_s"], rows["rudax"]["decode_s"])
    return {
        "preset": preset,
        "batch": batch,
        "prompt_lengths": lengths,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "greedy_outputs_equal": same,
        "arms": rows,
        "speed_vs_transformers": {"prefill": speed_prefill, "decode": speed_decode},
    }


def report(r: dict[str, Any]) -> str:
    lines = [
        f"generation, {r['preset']} Llama, batch {r['batch']} (prompts {r['prompt_lengths']}), "
        f"{r['new_tokens']} new tokens, greedy, fp32, {r['rounds']} rounds; outputs equal: "
        f"{r['greedy_outputs_equal']}",
        "",
        "| arm | prefill tokens/s | decode tokens/s |",
        "|---|---|---|",
    ]
    for arm, row in r["arms"].items():
        lines.append(
            f"| {arm} | {row['prefill_tokens_per_s']:,.0f} | {row['decode_tokens_per_s']:,.0f} |"
        )
    for what, (med, lo, hi) in r["speed_vs_transformers"].items():
        lines.append(f"\n{what}: rudax {med:.2f}x transformers' speed [{lo:.2f}, {hi:.2f}]")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)
    r = run(args.preset, args.batch, args.prompt_len, args.new_tokens, args.rounds)
    print(report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return r


if __name__ == "__main__":
    main()
