"""Checkpoints written by older rudax versions, kept to prove they still restore."""

from pathlib import Path

# Meta formats 2 and 3: one orbax item per record part (make.py says how they were written).
FORMATS_2_3 = Path(__file__).parent / "formats_2_3"
