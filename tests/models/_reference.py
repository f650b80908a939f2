"""What the tests of rudax.models ask of transformers, the reference, written once."""

import torch


def hf_greedy(ref, prompt, n):
    """transformers' greedy continuation of one prompt: exactly ``n`` new token ids."""
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
