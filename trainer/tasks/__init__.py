"""Tasks: one file per model family (`ddpm.py`, ...), each setting `TASK`; see base.py for the interface."""
