"""Cutting a model's layers into contiguous stages.

For now every stage gets an equal share; the topology-aware planner (memory, links,
family cut rules) grows here.
"""

from __future__ import annotations


class PlanError(ValueError):
    """The model cannot be cut as asked."""


def even_ranges(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """n_stages contiguous [start, end) ranges covering all layers, sizes within one of
    each other (earlier stages take the extra layers: stage 0 also embeds)."""
    if n_stages < 1:
        raise PlanError(f"stages must be at least 1, not {n_stages}")
    if n_stages > n_layers:
        raise PlanError(f"cannot cut {n_layers} layers into {n_stages} stages "
                        "(each stage needs at least one layer)")
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for i in range(n_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges
