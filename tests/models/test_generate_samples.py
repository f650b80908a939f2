"""rudax.models.generate with num_samples: G continuations of each prompt over one prefill,
the prompt's keys and values shared; traced sampling arguments; the sampled tokens'
log-probabilities; and the arguments it refuses.

References, each independent of the code under test: transformers' greedy generation and
logit warpers, a forward of the whole sequence without a cache (the log-probabilities a
trainer computes), softmax of a separate forward's logits (the sampling distribution, by a
chi-square test), and the cache's bytes written out from the shapes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from flax import nnx
from transformers.generation import logits_process as hf_warpers

import rudax.layers as rl
from rudax.models import Generation, LlamaConfig, LlamaForCausalLM, generate
from rudax.models._decode import run as _run
from rudax.models._generate import _cache_shapes
from rudax.models._sampling import Mode, filter_logits
from tests._catalog import Bad, Holds, catalog
from tests.models._reference import hf_greedy
from tests.models.test_llama import _hf_model, _ours

V = 128
PROMPTS = [[5, 17, 3, 99, 4, 8, 1, 12, 40, 2, 9], [7, 7, 2], [100]]
_forward = nnx.jit(lambda model, ids: model(ids))


def _tiny(vocab=V, head_scale=1.0, **overrides):
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        **overrides,
    )
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    if head_scale != 1.0:  # spread the logits: a random head's are all near 0
        head = model.lm_head.embedding
        head.set_value(head[...] * head_scale)
    return model


@pytest.fixture(scope="module")
def model():
    # a window of 6: past a few tokens it hides part of the shared prompt block
    return _tiny(sliding_window=6)


def test_greedy_samples_are_copies_of_the_one_row_path_and_of_transformers():
    """Mistral's window (8) is shorter than the first prompt: the window masks the shared
    prompt block and the samples' own slots both."""
    ref = _hf_model("mistral-window-8")
    ours = _ours(ref)
    one = generate(ours, PROMPTS, 24, stop_tokens=[])
    four = generate(ours, PROMPTS, 24, stop_tokens=[], num_samples=4)
    assert four == [row for row in one for _ in range(4)]  # prompt-major, 4 copies each
    for prompt, row in zip(PROMPTS, one, strict=True):
        assert row == hf_greedy(ref, prompt, 24), prompt


def test_sampling_is_reproducible_per_key_and_the_samples_differ(model):
    kw = dict(temperature=1.0, num_samples=3, stop_tokens=[])
    a = generate(model, PROMPTS[:2], 10, rng=jax.random.key(1), **kw)
    assert len(a) == 6 and all(len(row) == 10 for row in a)
    assert a == generate(model, PROMPTS[:2], 10, rng=jax.random.key(1), **kw)
    assert a != generate(model, PROMPTS[:2], 10, rng=jax.random.key(2), **kw)
    # a prompt's three samples are three draws (10 tokens from a near-uniform 128-way choice)
    assert len({tuple(row) for row in a[:3]}) == 3 and len({tuple(row) for row in a[3:]}) == 3


def _first_token_counts(model, n, **kw):
    out = generate(
        model, [[1, 2, 3]], 1, num_samples=n, rng=jax.random.key(7), stop_tokens=[], **kw
    )
    assert len(out) == n
    return np.bincount([row[0] for row in out], minlength=model.config.vocab_size)


def test_sampled_frequencies_follow_softmax_of_the_logits():
    """4000 samples of one prompt's first token over an 8-token vocabulary against the
    probabilities of a separate forward: chi-square at a fixed seed. The same counts reject a
    uniform choice, so the test can tell a wrong distribution."""
    model = _tiny(vocab=8, head_scale=60.0)
    logits = np.asarray(_forward(model, jnp.asarray([[1, 2, 3]])), np.float64)[0, -1]
    n = 4000
    p = np.exp(logits - logits.max())
    p /= p.sum()
    assert p.max() > 0.3 and p.min() < 0.05, p  # a distribution far from uniform
    counts = _first_token_counts(model, n, temperature=1.0)
    assert scipy.stats.chisquare(counts, n * p).pvalue > 1e-3
    assert scipy.stats.chisquare(counts).pvalue < 1e-9  # uniform is rejected
    # at temperature 0.5 with top_k=3: softmax(logits / 0.5) over the 3 largest, renormalized
    q = np.exp((logits - logits.max()) / 0.5)
    q[np.argsort(-logits)[3:]] = 0.0
    q /= q.sum()
    counts = _first_token_counts(model, n, temperature=0.5, top_k=3)
    assert counts[q == 0].sum() == 0
    assert scipy.stats.chisquare(counts[q > 0], n * q[q > 0]).pvalue > 1e-3


def test_logprobs_are_a_plain_forwards_log_softmax_at_the_temperature(model):
    """Each sampled token's log-probability against log_softmax(logits / T) of the whole
    sequence run without a cache (what a trainer computes), unfiltered; the tokens drawn lie
    in that forward's top-k. Greedy: log_softmax(logits), the argmax. The samples of a prompt
    differ, so a row reading another's slots, or the wrong prompt's, would be seen here."""
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5]]
    t, k = 0.7, 20
    got = generate(model, prompts, 10, temperature=t, top_k=k, top_p=0.95, num_samples=3,
                   rng=jax.random.key(3), stop_tokens=[], return_logprobs=True)  # fmt: skip
    greedy = generate(model, prompts, 10, stop_tokens=[], return_logprobs=True)
    assert isinstance(got, Generation) and len(got.tokens) == len(got.logprobs) == 6
    assert len({tuple(row) for row in got.tokens[:3]}) == 3  # a prompt's samples differ
    rows = [(prompts[i // 3], got.tokens[i], got.logprobs[i], t) for i in range(6)]
    rows += [(prompts[i], greedy.tokens[i], greedy.logprobs[i], None) for i in range(2)]
    for prompt, tokens, logprobs, temperature in rows:
        ids = jnp.asarray([prompt + tokens])
        logits = np.asarray(_forward(model, ids), np.float64)[0, len(prompt) - 1 : -1]
        scaled = logits / (1.0 if temperature is None else temperature)
        want = scaled - np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1))[:, None]
        want -= scaled.max(-1)[:, None]
        np.testing.assert_allclose(got_at := np.asarray(logprobs), want[np.arange(10), tokens],
                                   rtol=0, atol=1e-5)  # fmt: skip
        assert np.all(got_at <= 0)
        rank = (logits > logits[np.arange(10), tokens][:, None]).sum(-1)
        if temperature is None:
            assert np.all(rank == 0)  # greedy: the argmax
        else:
            assert np.all(rank < k)


def test_new_sampling_values_reuse_the_compiled_program(model):
    kw = dict(num_samples=2, rng=jax.random.key(0), stop_tokens=[])
    a = generate(model, PROMPTS, 12, temperature=0.7, top_k=40, top_p=0.9, **kw)
    compiled = _run._cache_size()
    b = generate(model, PROMPTS, 12, temperature=1.3, top_k=5, top_p=0.5, **kw)
    c = generate(model, PROMPTS, 12, temperature=0.2, top_k=200, top_p=1.0, **kw)
    assert _run._cache_size() == compiled, "a new temperature, top_k or top_p recompiled"
    assert a != b != c  # the new values were used


@pytest.mark.parametrize(("k", "p"), [(1, 1.0), (3, 0.3), (50, 0.9), (V + 5, 1e-6), (V, 0.7)])
def test_filters_keep_what_transformers_warpers_keep(k, p):
    """Temperature, then TopKLogitsWarper, then TopPLogitsWarper (transformers' order), on
    logits with ties at the k-th value; one compiled filter for every k and p."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 2.0, (6, V)).astype(np.float32)
    logits[:, :10] = np.round(logits[:, :10])  # ties
    t = 0.8
    scores = torch.from_numpy(logits)
    for warper in (hf_warpers.TemperatureLogitsWarper(t), hf_warpers.TopKLogitsWarper(k),
                   hf_warpers.TopPLogitsWarper(p)):  # fmt: skip
        scores = warper(None, scores)
    want = torch.isinf(scores).numpy()
    z = (logits - logits.max(-1, keepdims=True)) / t
    filtered = _filter_jit(jnp.asarray(z), jnp.int32(k), jnp.float32(p), Mode(False, True, True))
    np.testing.assert_array_equal(np.isinf(np.asarray(filtered)), want)
    assert _filter_jit._cache_size() == 1


_filter_jit = jax.jit(filter_logits, static_argnames="mode")


def test_the_cache_holds_each_prompt_once_and_each_samples_own_tokens(model):
    c = model.config
    layers, kv, hd = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    prompts = [list(range(1, 21)), list(range(1, 10))]  # padded to 32 slots
    shared = _cache_shapes(model, prompts, 10, num_samples=4)  # 10 tokens: 16 own slots
    for a in shared.prompt_keys + shared.prompt_values:
        assert a.shape == (2, kv, 32, hd) and a.dtype == jnp.float32
    for a in shared.sample_keys + shared.sample_values:
        assert a.shape == (8, kv, 16, hd)
    slot = 2 * layers * kv * hd * 4  # bytes of one slot's keys and values over the layers
    assert shared.nbytes == (2 * 32 + 8 * 16) * slot
    # 4 copies of each prompt, one sample each: every row holds its prompt
    copies = _cache_shapes(model, [p for p in prompts for _ in range(4)], 10)
    assert copies.nbytes == 8 * (32 + 16) * slot
    assert shared.size == copies.size == 48 and shared.num_samples == 4


def _lora(model):
    rl.apply_lora(model, ["q_proj", "v_proj", "down_proj"], rank=4, alpha=8, rngs=nnx.Rngs(1))
    for _, node in nnx.iter_graph(model):
        if isinstance(node, rl.LoRALinear):  # adapters as training would leave them
            node.lora_b.set_value(node.lora_b[...] + 0.3)
    return model


def _qlora(model):
    rl.apply_lora(model, ["q_proj", "down_proj"], rank=4, alpha=8, quantize_base="nf4",
                  rngs=nnx.Rngs(1))  # fmt: skip
    return model


def _stacked(model):
    model.scan_layers = True
    return model


VARIANTS = {
    "lora": lambda: _lora(_tiny()),
    "qlora-nf4": lambda: _qlora(_tiny()),
    "stacked": lambda: _stacked(_tiny(sliding_window=4)),
    "mixtral": lambda: _tiny(model_type="mixtral", num_local_experts=3, num_experts_per_tok=2),
}


@pytest.mark.parametrize(
    "variant",  # LoRA's adapters are QLoRA's over another base: it behind -m slow
    [pytest.param(v, marks=pytest.mark.slow) if v == "lora" else v for v in VARIANTS],
)
def test_samples_of_every_model_kind_share_the_prompt(variant):
    model = VARIANTS[variant]()
    one = generate(model, PROMPTS[:2], 8, stop_tokens=[])
    assert generate(model, PROMPTS[:2], 8, stop_tokens=[], num_samples=2) == [
        row for row in one for _ in range(2)
    ]


def _bad_temperature_model():
    # logits of about +-20: divided by a tiny temperature they overflow float32
    return _tiny(vocab=8, head_scale=300.0)


def _smallest_normal_temperature_is_greedy():
    model = _bad_temperature_model()
    tiny = float(np.finfo(np.float32).tiny)
    prompts = [[1, 2, 3], [4], [5, 6], [7, 1, 1, 2]]
    greedy = generate(model, prompts, 12, stop_tokens=[])
    assert generate(model, prompts, 12, temperature=tiny, stop_tokens=[]) == greedy


def _numpy_stop_tokens_stop_as_ints_do():
    """Issue 39: stop_tokens=np.int64(2) raised a TypeError (np.int64 is no Python int)."""
    model, prompts = _tiny(vocab=16), [[1, 2, 3], [4, 5]]
    t = generate(model, prompts, 12, stop_tokens=[])[0][3]  # the first row's fourth token
    want = generate(model, prompts, 12, stop_tokens=[t])
    assert len(want[0]) <= 4
    for stops in (np.int64(t), np.uint8(t), np.array(t), jnp.asarray(t), np.array([t, 99])):
        assert generate(model, prompts, 12, stop_tokens=stops) == want, repr(stops)


def _model():
    return _tiny()


CASES = [
    Bad("float-token-ids", lambda: generate(_model(), [[1.0, 2.7]], 4), TypeError,
        r"prompts\[0\]\[0\] must be an int token id, got 1\.0"),
    Bad("float-id-array", lambda: generate(_model(), np.array([[1.0, 2.0]]), 4), TypeError,
        r"prompts must hold integer token ids, got an array of dtype float64"),
    Bad("bool-token-id", lambda: generate(_model(), [[1, True]], 4), TypeError,
        r"prompts\[0\]\[1\] must be an int token id, got True"),
    Bad("a-flat-prompt", lambda: generate(_model(), [1, 2, 3], 4), TypeError,
        r"prompts\[0\] must be a sequence of token ids, got 1"),
    Bad("num-samples-0", lambda: generate(_model(), [[1]], 4, num_samples=0), ValueError,
        r"num_samples must be >= 1, got num_samples=0"),
    Bad("num-samples-float", lambda: generate(_model(), [[1]], 4, num_samples=2.0), TypeError,
        r"num_samples must be an int, got num_samples=2\.0"),
    Bad("num-samples-bool", lambda: generate(_model(), [[1]], 4, num_samples=True), TypeError,
        r"num_samples must be an int, got num_samples=True"),
    Bad("temperature-subnormal",
        lambda: generate(_model(), [[1]], 4, temperature=1e-45), ValueError,
        r"temperature must be 0 \(greedy\) or at least 1\.1754944e-38, float32's smallest "
        r"normal number .* got temperature=1e-45"),
    Bad("temperature-inf",
        lambda: generate(_model(), [[1]], 4, temperature=float("inf")), ValueError,
        r"temperature must be finite in float32 .* got temperature=inf"),
    Bad("temperature-nan",
        lambda: generate(_model(), [[1]], 4, temperature=float("nan")), ValueError,
        r"temperature must be a number >= 0, got nan"),
    Bad("return-logprobs-not-bool",
        lambda: generate(_model(), [[1]], 4, return_logprobs=1), TypeError,
        r"return_logprobs must be a bool, got return_logprobs=1"),
    Holds("temperature-smallest-normal-is-greedy", _smallest_normal_temperature_is_greedy),
    # issue 39: an OverflowError from jnp.asarray(2**40, int32)
    Bad("max-new-tokens-2**40", lambda: generate(_model(), [[1]], 2**40), ValueError,
        r"max_new_tokens must be at most 2\*\*30 = 1,073,741,824 \(the cache holds the next "
        r"power of two of slots, and positions are int32\), got 1,099,511,627,776"),
    Holds("stop-tokens-numpy-integers", _numpy_stop_tokens_stop_as_ints_do),
    Bad("stop-tokens-float", lambda: generate(_model(), [[1]], 4, stop_tokens=[2.0]),
        TypeError, r"stop_tokens must hold int token ids, got 2\.0 in \[2\.0\]"),
    Bad("stop-tokens-float-array",
        lambda: generate(_model(), [[1]], 4, stop_tokens=np.array([2.0])), TypeError,
        r"stop_tokens must be an int or a sequence of int token ids, got an array of dtype "
        r"float64 and shape \(1,\)"),
    Bad("stop-tokens-negative", lambda: generate(_model(), [[1]], 4, stop_tokens=-3),
        ValueError, r"stop_tokens must hold token ids in \[0, 2\*\*31\), got -3"),
]  # fmt: skip
test_bad_generate_input = catalog(CASES)
