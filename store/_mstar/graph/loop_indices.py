"""Where execution is across nested loops (mstar.graph.loop_indices)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class NestedLoopIndices:
    """A snapshot of the forward pass and of every loop's index, outer loop first."""

    loop_name_order: list[str]
    loop_indices: dict[str, int]
    wg_fwd_pass_idx: int

    def label_context_gt(
        self, other: NestedLoopIndices | None, target_loop_name: str | None = None
    ) -> bool:
        """True when ``self`` is strictly later than ``other``.

        Compared first by forward pass, then loop by loop from the outermost, stopping before
        ``target_loop_name``; a loop without an index counts as 0 and ``None`` is earliest.
        """
        if other is None:
            return True
        if self.wg_fwd_pass_idx > other.wg_fwd_pass_idx:
            return True
        if self.wg_fwd_pass_idx < other.wg_fwd_pass_idx:
            return False
        for name in self.loop_name_order:
            if target_loop_name is not None and name == target_loop_name:
                break
            our_idx = self.loop_indices.get(name, 0)
            their_idx = other.loop_indices.get(name, 0)
            if our_idx > their_idx:
                return True
            if our_idx < their_idx:
                return False
        return False

    def max(self, other: NestedLoopIndices | None) -> NestedLoopIndices:
        """The later of the two snapshots (``self`` on a tie)."""
        if other is None:
            return self
        if other.label_context_gt(self):
            return other
        return self
