"""`python -m trainer` is the `gentrain` command (torchrun runs `-m trainer train`)."""

import sys

from trainer.cli import main

sys.exit(main())
