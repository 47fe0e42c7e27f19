"""Differentiable halo statistics for forward models: soft halo counts and kNN-CDFs."""

from .abundance import soft_counts

__all__ = ["soft_counts"]
