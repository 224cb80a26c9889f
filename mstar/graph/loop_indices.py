"""Where execution is across nested loops, so that loop-stop labels can be ordered."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NestedLoopIndices:
    """A snapshot of the forward pass and of every loop's index, outer loop first."""

    loop_name_order: list[str] = field(default_factory=list)
    loop_indices: dict[str, int] = field(default_factory=dict)
    wg_fwd_pass_idx: int = 0

    def label_context_gt(
        self, other: NestedLoopIndices | None, target_loop_name: str | None = None
    ) -> bool:
        """True when ``self`` is strictly later than ``other``.

        Compared first by forward pass, then loop by loop from the outermost, stopping before
        ``target_loop_name``; a loop without an index counts as 0 and ``None`` is earliest.
        """
        if other is None:
            return True
        if self.wg_fwd_pass_idx != other.wg_fwd_pass_idx:
            return self.wg_fwd_pass_idx > other.wg_fwd_pass_idx
        for name in self.loop_name_order:
            if name == target_loop_name:
                break
            mine = self.loop_indices.get(name, 0)
            theirs = other.loop_indices.get(name, 0)
            if mine != theirs:
                return mine > theirs
        return False

    def max(self, other: NestedLoopIndices | None) -> NestedLoopIndices:
        """The later of the two snapshots (``self`` on a tie)."""
        if other is not None and other.label_context_gt(self):
            return other
        return self
