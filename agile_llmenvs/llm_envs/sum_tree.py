"""A sum tree: weighted draws and weight updates in O(log n)."""

from __future__ import annotations

from array import array

import numpy as np

__all__ = ["SumTree"]


class SumTree:
    """Non-negative weights over ``size`` items, drawn in proportion in O(log n).

    The weights sit in the leaves of a complete binary tree whose inner nodes hold the sums
    of their children, so an update walks one root path and a draw descends one. The nodes
    are an ``array('d')`` (8 bytes each, as in numpy) because the walks are single reads,
    which an array serves as plain Python floats at about a third of a numpy scalar read's
    cost out of cache; the tree is built level by level in numpy.
    """

    def __init__(self, size: int, initial: float = 1.0) -> None:
        if size < 1:
            raise ValueError(f"a sum tree needs at least one item, got {size}")
        self.size = size
        self.capacity = 1 << (size - 1).bit_length()
        nodes = np.zeros(2 * self.capacity, dtype=np.float64)
        nodes[self.capacity : self.capacity + size] = initial
        width = self.capacity
        while width > 1:  # each level: the pairwise sums of the one below
            below = nodes[width : 2 * width]
            nodes[width // 2 : width] = below[0::2] + below[1::2]
            width //= 2
        self.tree = array("d", nodes.tobytes())

    @property
    def total(self) -> float:
        """The sum of all weights."""
        return self.tree[1]

    def weight(self, index: int) -> float:
        """The weight of item ``index``."""
        return self.tree[self.capacity + index]

    def update(self, index: int, weight: float) -> None:
        """Set item ``index``'s weight."""
        if weight < 0:
            raise ValueError(f"weights are non-negative, got {weight}")
        node = self.capacity + index
        delta = weight - self.tree[node]
        while node >= 1:
            self.tree[node] += delta
            node //= 2

    def find(self, mass: float) -> int:
        """The item whose cumulative weight interval holds ``mass`` (0 <= mass < total)."""
        tree, node = self.tree, 1
        while node < self.capacity:
            left = 2 * node
            if mass < tree[left]:
                node = left
            else:
                mass -= tree[left]
                node = left + 1
        return min(node - self.capacity, self.size - 1)

    def sample(self, rng: np.random.Generator) -> int:
        """Draw one item with probability proportional to its weight."""
        return self.find(float(rng.random()) * self.total)
