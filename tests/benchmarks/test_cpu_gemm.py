"""benchmarks/cpu_gemm: the list of a step's matrix products is the model's (their FLOPs
are 3x the forward's, the weight gradients have the kernels' shapes), and a tiny run
reports both libraries."""

import numpy as np
from flax import nnx

from benchmarks import cpu_gemm
from benchmarks._trainer import trainer_recipe

SIZES = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2)


def test_the_products_are_the_models():
    recipe = trainer_recipe(seq_len=64, **SIZES)
    products = cpu_gemm.recipe_products(recipe)
    model = recipe.spec.create(0)
    kernels = [
        v.get_value().shape for path, v in nnx.iter_graph(model)
        if isinstance(v, nnx.Param) and path[-1] == "kernel"
    ]  # fmt: skip
    tokens = recipe.batch_size * recipe.spec.seq_len
    matrix_params = sum(int(np.prod(s)) for s in kernels)
    table = recipe.spec.config.vocab_size * recipe.spec.config.hidden_size
    flops = {
        part: sum(p.flops * p.count for p in products if p.part == part)
        for part in "forward dx dW".split()
    }
    assert flops["forward"] == 2 * tokens * (matrix_params + table)
    assert flops["dx"] == flops["dW"] == flops["forward"]
    # each weight gradient [in, out] is a kernel's shape, as often as the model has it
    grads: dict = {}
    for p in products:
        if p.part == "dW" and p.name != "head":
            grads[p.m, p.n] = grads.get((p.m, p.n), 0) + p.count
    assert grads == {s: kernels.count(s) for s in set(kernels)}


def test_a_tiny_run_reports_both_libraries():
    products = cpu_gemm.step_products(
        tokens=64, hidden=32, mlp=64, vocab=128, layers=1, chunk=32, kv_width=16
    )
    rows = cpu_gemm.measure(products[:3] + products[-2:], rounds=1, iters=1)
    text = cpu_gemm.report(rows)
    assert "one step: jax " in text and ", torch " in text
    assert all(r["jax"] > 0 and r["torch"] > 0 for r in rows)
