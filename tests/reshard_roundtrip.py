"""Test-only: resume a checkpoint at this world size / parallel mode and save it again, untrained.

`torchrun ... tests/reshard_roundtrip.py OUT_URL [key=value ...]` loads the newest
valid checkpoint under checkpoint.url through the real Trainer (resharding as
needed) and writes the same step under OUT_URL, so a test can compare the two
checkpoints tensor by tensor.
"""

from __future__ import annotations

import sys

from trainer.config import split_preset
from trainer.engine.checkpoints import CheckpointManager
from trainer.loop import Trainer
from trainer.registry import load_config


def main() -> None:
    out_url, args = sys.argv[1], sys.argv[2:]
    cfg = load_config(*split_preset(args))
    trainer = Trainer(cfg)
    assert trainer.checkpoints.resume() is not None, "nothing to resume from"
    out_cfg = load_config(*split_preset([*args, f"checkpoint.url={out_url}"]))
    out = CheckpointManager(out_cfg, trainer.runtime, trainer.metrics)
    out.attach(trainer.progress, trainer.parts, {n: f.record for n, f in trainer.frozen.items()})
    assert out.save(trainer.progress.step, sync=True, final=True)
    out.close()
    trainer.close()


if __name__ == "__main__":
    main()
