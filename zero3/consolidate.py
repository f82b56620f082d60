"""``python -m zero3.consolidate CKPT_DIR OUT``: the command-line entry of
`zero3.checkpoint.consolidate` (one full state dict from a sharded checkpoint, streaming, offline)."""

import sys

from .checkpoint.consolidate import cli

if __name__ == "__main__":
    sys.exit(cli())
