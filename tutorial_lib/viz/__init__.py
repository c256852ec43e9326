"""Widgets of the course: self-contained HTML that works live and in the static book."""
from .colors import KIND_COLORS, PALETTE, group_color, kind_color
from .rank_map import RankMap, rank_map, rank_map_explorer

__all__ = ["KIND_COLORS", "PALETTE", "group_color", "kind_color", "RankMap", "rank_map", "rank_map_explorer"]
