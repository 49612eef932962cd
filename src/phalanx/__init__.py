"""phalanx: run PyTorch training jobs on one machine or many, and keep them running."""

__version__ = "0.1.0"
