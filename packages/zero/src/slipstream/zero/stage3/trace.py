"""ExecutionTrace: the order units ran in on the first iteration, replayed to prefetch."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable

from slipstream.zero.stage3.state import ShardState
from slipstream.zero.stage3.unit import ParamUnit

__all__ = ["ExecutionTrace"]

# Elements gathered now, or a function that counts them (see ExecutionTrace._upcoming).
LiveNumel = int | Callable[[], int]

logger = logging.getLogger(__name__)


class ExecutionTrace:
    """Records the forward order of units once, then prefetches along it.

    The first forward is recorded. Later forwards check
    each unit against the recording; while they agree, the pre-forward of unit ``k`` starts
    the all-gathers of units ``k+1, k+2, ...`` until ``prefetch_numel`` elements are on their
    way (the unit that crosses it included, as DeepSpeed counts: a unit larger than the whole
    budget is still prefetched, one ahead), as long as the gathered elements stay under
    ``max_live_numel``. Backward walks the recording in
    reverse from the unit that just started its backward. A forward that departs from the
    recording (data-dependent control flow) stops prefetching for the rest of the iteration;
    correctness never depends on the trace, only overlap does. A unit whose next call comes
    within ``max_reuse_numel`` elements of other units stays gathered until then.
    """

    def __init__(self, prefetch_numel: int, max_live_numel: int, max_reuse_numel: int = 0) -> None:
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_numel = max_reuse_numel
        self.order: list[ParamUnit] = []
        self.recording = True
        self._position = 0
        self._following = True
        self._last_index: dict[int, int] = {}
        # Frozen with the recording: each unit's call positions, and the elements of the
        # recorded calls before each position (reused_soon in O(log n), not a walk).
        self._calls: dict[int, list[int]] = {}
        self._prefix: list[int] = [0]

    def finish_recording(self) -> None:
        """Freeze the recorded order (at the end of the first forward)."""
        if self.recording:
            self.recording = False
            self._last_index = {id(u): i for i, u in enumerate(self.order)}
            self._calls = {}
            self._prefix = [0]
            for i, u in enumerate(self.order):
                self._calls.setdefault(id(u), []).append(i)
                self._prefix.append(self._prefix[-1] + u.numel)
            logger.debug("stage-3 trace recorded: %d module calls", len(self.order))

    def begin_iteration(self) -> None:
        """A new forward starts at the top of the recording."""
        self._position = 0
        self._following = True

    def on_forward(self, unit: ParamUnit, live_numel: LiveNumel) -> list[ParamUnit]:
        """Note that ``unit`` starts its forward; return the units to prefetch now.

        ``live_numel``: the elements gathered now, or a function computing them (called only
        when a unit is a candidate: walking every unit on every hook costs host time)."""
        if self.recording:
            self.order.append(unit)
            return []
        if not self._following or self._position >= len(self.order):
            return []
        if self.order[self._position] is not unit:
            self._following = False
            return []
        self._position += 1
        order = self.order
        return self._upcoming((order[i] for i in range(self._position, len(order))), live_numel)

    def reused_soon(self, unit: ParamUnit) -> bool:
        """Whether ``unit`` (just done with a forward call) is called again soon.

        Soon: before more than ``max_reuse_numel`` elements of other units are gathered, going
        by the recording (DeepSpeed's ``stage3_max_reuse_distance``). Keeping it gathered
        saves an all-gather and costs its memory until then.
        """
        if self.recording or not self._following or self.max_reuse_numel <= 0:
            return False
        calls = self._calls.get(id(unit), [])
        at = bisect.bisect_left(calls, self._position)
        if at == len(calls):
            return False  # not called again in this forward
        between = self._prefix[calls[at]] - self._prefix[self._position]
        return between <= self.max_reuse_numel

    def on_backward(self, unit: ParamUnit, live_numel: LiveNumel) -> list[ParamUnit]:
        """Note that ``unit`` starts its backward; return the units (earlier in forward) to prefetch."""
        if self.recording or id(unit) not in self._last_index:
            return []
        index = self._last_index[id(unit)]
        order = self.order
        return self._upcoming((order[i] for i in range(index - 1, -1, -1)), live_numel)

    def ahead(self, unit: ParamUnit, backward: bool) -> list[ParamUnit]:
        """The units due after ``unit`` along the recording, nearest first (empty while
        recording or off the trace): forward, from the current position on; backward, the
        units before ``unit``'s last forward call, in reverse. NVMe parameter offload reads
        their shards ahead of the all-gathers."""
        if self.recording:
            return []
        if backward:
            index = self._last_index.get(id(unit))
            return [] if index is None else self.order[:index][::-1]
        if not self._following:
            return []
        return self.order[self._position :]

    def _upcoming(self, candidates: Iterable[ParamUnit], live_numel: LiveNumel) -> list[ParamUnit]:
        """[Note: prefetch budget] ``prefetch_numel`` bounds the elements gathered *ahead*:
        walking the trace from the unit in use, the units already prefetched (in flight or
        landed, not yet used) count against it, and new ones are taken while less than the
        budget is ahead, the one that crosses it included (a unit larger than the whole
        budget is still prefetched, one ahead, as DeepSpeed counts).

        Before, each hook took a fresh budget past the units already prefetched, so every
        module started ``prefetch_numel`` more elements while using one unit: the prefetch ran
        away until ``max_live_numel`` (1e9 elements by default, most of a 1.3B model)
        stopped it, which flooded the communication stream with all-gathers the reduce-scatters
        queued behind (the compute stream waits for those) and held up to 2 GB more of
        gathered bf16 parameters at the start of backward. And a unit larger than the budget
        (the 7B MLP's 90M-element ``up``, the embedding and head) was never prefetched."""
        chosen: list[ParamUnit] = []
        ahead = 0
        live: int | None = None
        for unit in candidates:
            if ahead >= self.prefetch_numel:
                break
            if unit.prefetch_hold:
                ahead += unit.numel
                continue
            need = unit.sharded_numel()
            if need == 0:
                continue
            if live is None:
                live = live_numel() if callable(live_numel) else live_numel
            if live + need > self.max_live_numel:
                break
            ahead += need
            live += need
            chosen.append(unit)
        return chosen

    @staticmethod
    def live_numel(units: list[ParamUnit]) -> int:
        """Elements currently gathered across ``units`` (each parameter counted once)."""
        seen: dict[int, int] = {}
        for unit in units:
            for member in unit.members:
                if member.state is ShardState.UNSHARDED:
                    seen[id(member)] = member.spec.numel
        return sum(seen.values())
