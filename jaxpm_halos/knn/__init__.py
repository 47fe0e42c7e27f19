"""k nearest neighbours: lists (:func:`knn`), densities (:func:`knn_density`), on one
device (:func:`knn_local`) or on an existing decomposition (:func:`knn_on_decomposition`)."""

from .knn import knn, knn_density, knn_local, knn_on_decomposition

__all__ = ["knn", "knn_density", "knn_local", "knn_on_decomposition"]
