"""The engine: the runtime, parts and their wrapping, the step (phases, chunks, scaling), validation,
previews, evaluation, reporting, and saving and resuming checkpoints (`checkpoints.py`, on the storage
library `trainer.checkpoint`).

The loop (trainer/loop.py) makes the runtime (`runtime.py`: process env, device, precision, parallel
mode) once and hands it to the components by keyword; `wrap.py` wraps the parts for one process, DDP or
FSDP. Each component decides its own timing and owns its saved state (`state_dict` / `load_state_dict`).
"""
