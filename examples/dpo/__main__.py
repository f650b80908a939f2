"""``python -m examples.dpo``: the DPO program (examples/dpo/train.py)."""

from examples.dpo.train import main

if __name__ == "__main__":
    main()
