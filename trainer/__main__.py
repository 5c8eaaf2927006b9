"""`python -m trainer` is the `gentrain` command (torchrun runs `-m trainer train`)."""

from trainer.cli import run

run()
