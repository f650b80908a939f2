"""``python -m examples.finetune``: the fine-tuning program (examples/finetune/train.py)."""

from examples.finetune.train import main

if __name__ == "__main__":
    main()
