"""``flops_per_token``: a Llama-family model's training FLOPs per token, for MFU."""

from __future__ import annotations

from rudax.models._llama_config import LlamaConfig

__all__ = ["flops_per_token"]


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward) of the model's matmuls, for MFU.

    ``6 N`` for the ``N`` matmul parameters a token actually uses (2 FLOPs per multiply-add
    forward, twice that backward), attention's score and value products, and the head::

        N     = L * (d H K + 2 d G K + H K d + 3 d I k + d E)
                    (H query and G key/value heads of K channels; k = num_experts_per_tok
                     and E = num_local_experts for a Mixtral, else 1 and 0)
        flops = 6 N + 6 L H K S + 6 d V

    where ``S`` is the keys a query sees on average, doubled: ``seq_len`` for causal
    attention (the causal half of PaLM's ``12 L H K T``, appendix B), and ``2 W - W^2 / T``
    under a window of ``W < T`` keys. Grouped-query attention does not change the attention
    term (every query head still scores every key it sees). The embedding lookup is not a
    matmul and counts nothing; the head counts once, tied or not; biases are not matmuls.
    For a Mixtral this is the model's FLOPs, not the hardware's: ``set_moe_impl("dense")``
    computes every expert.

    Args:
      config: a ``LlamaConfig``.
      seq_len: T, the trained sequence length, >= 1.

    Returns:
      FLOPs per trained token, a float.

    Example:
      >>> from rudax.models import LlamaConfig, flops_per_token
      >>> config = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=704,
      ...                      num_hidden_layers=4, num_attention_heads=4)
      >>> round(flops_per_token(config, 256) / 1e6, 2)  # MFLOPs per token
      33.42

    References:
      Chowdhery et al., `PaLM <https://arxiv.org/abs/2204.02311>`_, 2022, appendix B;
      Kaplan et al., `Scaling Laws for Neural Language Models
      <https://arxiv.org/abs/2001.08361>`_, 2020 (the 6N rule).
    """
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"config must be a rudax.models.LlamaConfig, got {config!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len=!r}")
    c = config
    assert c.head_dim is not None and c.num_key_value_heads is not None  # filled when built
    d, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    experts, k = (c.num_local_experts, c.num_experts_per_tok) if c.num_local_experts else (0, 1)
    n = c.num_hidden_layers * (
        2 * d * q + 2 * d * kv + 3 * d * c.intermediate_size * k + d * experts
    )
    window = c.sliding_window
    seen = (
        float(seq_len) if window is None or window >= seq_len else 2 * window - window**2 / seq_len
    )
    attention = 6 * c.num_hidden_layers * q * seen
    return float(6 * n + attention + 6 * d * c.vocab_size)
