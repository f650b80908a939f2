"""examples.lm.plan against XLA's memory_analysis on the shapes of a real model (issue 29).

``tests/lm/test_plan.py`` compares the plan with XLA on small models, where the vocabulary
is a few thousand and every term the plan missed was small. A user's SmolLM-135M QLoRA
(vocabulary 49152, 9 query and 3 key/value heads, hidden 576, tied head) planned 1.44 GB
against XLA:CPU's 2.62 GB (x0.55), and 1.05 against 1.14 scanned. Here the same shapes with
3 of its 30 layers: what the plan missed was per layer or per vocabulary, and both show at 3
(the plan now says 2.57 and 1.15 GB at 30 layers).

The reference is ``plan_xla.compiled_steps``, the programs' own jitted steps compiled for the
CPU on abstract inputs (``tests/lm/test_plan.py`` checks that they are the steps the programs
run). Compared: what each step adds to the resident state, XLA's ``output - aliased + temp``.

Bounds, planned over XLA's: fine-tuning within 10%, the trainer within 20%. Measured when
written (jax 0.10.2, XLA:CPU), microbatch and update: fine-tuning 0.99-1.00 (the plan before
issue 29: 0.61-0.74 for the microbatch), the trainer 0.82-1.07 (before: 0.71-0.85). The
trainer's bound is wider because XLA:CPU packs its temporaries into one allocation that can
exceed what is live at its peak, and the trainer has three vocabulary-sized fp32 buffers
(the tied table's gradient, its scatter's zeros, the loss's table gradient) that the packing
leaves holes between: with ``data=8`` at 4 layers 399 MB are live at the peak and 566 MB
allocated; the plan says 490. A term of the size of those the plan missed fails the bound
(per layer of XLA's 72 MB: the dequantized base 14, the dropout masks' uint32 halves 20; the
loss's second logits-sized buffer, 100 MB in all).
"""

from __future__ import annotations

import json

import pytest

from examples.lm import plan as pl
from examples.lm import plan_xla

LAYERS = 3
# SmolLM-135M's config.json (HuggingFaceTB/SmolLM-135M), 3 of its 30 layers.
SMOLLM = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 0,
}
FINETUNE_TOLERANCE = 0.10
TRAINER_TOLERANCE = 0.20


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm") / "config.json"
    path.write_text(json.dumps(SMOLLM))
    return str(path)


def _ratios(argv: list[str]) -> dict[str, float]:
    """Planned over XLA's bytes added by each step."""
    args = pl.build_parser().parse_args(argv)
    plan = pl.make_plan(args)
    _, xla = plan_xla.compiled_steps(args)
    planned = {
        "microbatch": plan.micro_peak - plan.resident,
        "update": plan.apply_peak - plan.resident,
    }
    return {k: planned[k] / xla[k].added for k in planned}


@pytest.mark.parametrize(
    "flags",
    [
        "--finetune qlora",  # the user's case: dropout 0.05 on every adapter, layers unrolled
        "--finetune qlora --scan-layers --dropout 0",
        pytest.param("--finetune lora", marks=pytest.mark.slow),  # QLoRA's, unquantized
    ],
)
def test_finetuning_plan_agrees_with_xla_on_real_shapes(smollm, flags):
    argv = ["--hf-config", smollm, "--seq-len", "128", "--batch-size", "4", *flags.split()]
    ratios = _ratios(argv)
    assert all(abs(r - 1.0) <= FINETUNE_TOLERANCE for r in ratios.values()), ratios


@pytest.mark.parametrize(
    "flags",
    [
        "--batch-size 4",  # one device
        pytest.param("--batch-size 16 --mesh data=8", marks=pytest.mark.slow),  # and scanned:
        "--batch-size 16 --mesh data=8 --scan-layers --remat full",
    ],
)
def test_pretraining_plan_agrees_with_xla_on_real_shapes(smollm, flags):
    argv = ["--hf-config", smollm, "--seq-len", "128", "--optimizer", "adamw", *flags.split()]
    ratios = _ratios(argv)
    assert all(abs(r - 1.0) <= TRAINER_TOLERANCE for r in ratios.values()), ratios
