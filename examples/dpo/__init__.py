"""DPO of a LoRA / QLoRA policy on a Hugging Face base, on chosen/rejected pairs; a PEFT
adapter out.

    python -m examples.dpo --base <HF dir> --data pairs.jsonl --val-data held_out.jsonl

``data`` reads the pairs (TRL's format) and serves batch ``i`` as a pure function of the
file, the seed and ``i``; ``train`` is the run, on ``examples.policy``.
"""
