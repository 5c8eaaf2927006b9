"""gentrain: one training core for generative image models, from a laptop CPU to preemptible GPU clusters."""

__version__ = "0.1.0"
