"""Tasks: one file per model family (`ddpm.py`, ...), each setting `TASK`; see base.py for the interface.

A task module is a plug-in: it imports the interface (base.py), the skeletons several tasks share
(base_gan.py, base_maskgit.py: not tasks), the sampling contract, and models/, diffusion/ and conditioning/,
never another task module (tests/test_backbones.py)."""
