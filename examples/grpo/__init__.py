"""GRPO of a LoRA / QLoRA policy on a Hugging Face base, rewarded by Python functions; a PEFT
adapter out.

    python -m examples.grpo --base <HF dir> --data prompts.jsonl --reward exact_match

``data`` reads the prompts and their fields; ``train`` is the run, on ``examples.policy``:
each generation samples G completions of a batch of prompts (``rudax.post_train.rollout``,
each prompt's keys and values cached once), rewards them, and trains on them for
``--num-iterations`` updates.
"""
