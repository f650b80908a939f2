"""``python -m examples.grpo``: the GRPO program (examples/grpo/train.py)."""

from examples.grpo.train import main

if __name__ == "__main__":
    main()
