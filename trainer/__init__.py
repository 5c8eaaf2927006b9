"""gentrain: one training core for generative image models, from a laptop CPU to preemptible GPU clusters."""

import logging

from trainer import lazy_packages

__version__ = "0.1.0"


class _KnownImportNoise(logging.Filter):
    """Drops the warnings that importing diffusers logs whenever torchao (the `lowbit` extra) is installed:
    diffusers' quantizers import torchao, whose import reports each CUDA extension a CPU build cannot load
    ("Failed to load .../_C_*.so": they serve its float8/MX kernels, not its optimizers) and a missing
    Triton ("Detected no triton": for its int8 matmul kernels, which gentrain does not use), which makes torch
    log a pytree deprecation notice ("... is an Enum subclass ..."), and diffusers 0.42 then misses a torchao
    class it lists for torch.load ("Unable to import `torchao` Tensor objects"; gentrain never torch.loads).
    Only these messages, only on these loggers: anything else they log still shows."""

    _DROP = {
        "torchao": ("Failed to load ",),
        "torchao.kernel.intmm": ("Warning: Detected no triton",),
        "torch.utils._pytree": ("%s is an Enum subclass",),
        "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",),
    }

    def filter(self, record: logging.LogRecord) -> bool:
        prefixes = self._DROP.get(record.name, ())
        return not str(record.msg).startswith(prefixes)


for _name in _KnownImportNoise._DROP:
    logging.getLogger(_name).addFilter(_KnownImportNoise())


lazy_packages.install()  # before anything imports diffusers (see trainer/lazy_packages.py)
