"""The engine: parts, the step (phases, chunks, scaling), validation, previews and reporting.

The loop (trainer/loop.py) calls these; each component decides its own timing
and owns its saved state (`state_dict` / `load_state_dict`).
"""
