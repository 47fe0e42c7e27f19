"""Merger links between snapshots, and the main branches they make."""

from .links import MergerLinks, merger_links
from .tree import along_branches, main_branches, snapshot_links

__all__ = ["MergerLinks", "along_branches", "main_branches", "merger_links", "snapshot_links"]
