"""Differentiable halo statistics for forward models: soft halo counts and kNN-CDFs (the
smooth SO masses are :func:`~jaxpm_halos.spherical_overdensity`'s ``smoothing``)."""

from .abundance import soft_counts
from .knn_cdf import knn_cdf, knn_cdf_on_snapshot, random_queries, register_knn_cdf

__all__ = ["knn_cdf", "knn_cdf_on_snapshot", "random_queries", "register_knn_cdf", "soft_counts"]
