"""`python -m qkvlab ...` (and `torchrun ... -m qkvlab train ...`): the `qkvlab` command."""

import sys

from qkvlab.cli import main

if __name__ == "__main__":
    sys.exit(main())
