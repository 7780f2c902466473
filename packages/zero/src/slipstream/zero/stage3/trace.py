"""ExecutionTrace: the order units ran in on the first iteration, replayed to prefetch."""

from __future__ import annotations

import logging

from slipstream.zero.stage3.state import ShardState
from slipstream.zero.stage3.unit import ParamUnit

__all__ = ["ExecutionTrace"]

logger = logging.getLogger(__name__)


class ExecutionTrace:
    """Records the forward order of units once, then prefetches along it.

    The first forward is recorded. Later forwards check
    each unit against the recording; while they agree, the pre-forward of unit ``k`` starts
    the all-gathers of units ``k+1, k+2, ...`` up to ``prefetch_numel`` elements, as long as
    the gathered elements stay under ``max_live_numel``. Backward walks the recording in
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

    def finish_recording(self) -> None:
        """Freeze the recorded order (at the end of the first forward)."""
        if self.recording:
            self.recording = False
            self._last_index = {id(u): i for i, u in enumerate(self.order)}
            logger.debug("stage-3 trace recorded: %d module calls", len(self.order))

    def begin_iteration(self) -> None:
        """A new forward starts at the top of the recording."""
        self._position = 0
        self._following = True

    def on_forward(self, unit: ParamUnit, live_numel: int) -> list[ParamUnit]:
        """Note that ``unit`` starts its forward; return the units to prefetch now."""
        if self.recording:
            self.order.append(unit)
            return []
        if not self._following or self._position >= len(self.order):
            return []
        if self.order[self._position] is not unit:
            self._following = False
            return []
        self._position += 1
        return self._upcoming(self.order[self._position :], live_numel)

    def reused_soon(self, unit: ParamUnit) -> bool:
        """Whether ``unit`` (just done with a forward call) is called again soon.

        Soon: before more than ``max_reuse_numel`` elements of other units are gathered, going
        by the recording (DeepSpeed's ``stage3_max_reuse_distance``). Keeping it gathered
        saves an all-gather and costs its memory until then.
        """
        if self.recording or not self._following or self.max_reuse_numel <= 0:
            return False
        distance = 0
        for upcoming in self.order[self._position :]:
            if upcoming is unit:
                return True
            distance += upcoming.numel
            if distance > self.max_reuse_numel:
                return False
        return False

    def on_backward(self, unit: ParamUnit, live_numel: int) -> list[ParamUnit]:
        """Note that ``unit`` starts its backward; return the units (earlier in forward) to prefetch."""
        if self.recording or id(unit) not in self._last_index:
            return []
        index = self._last_index[id(unit)]
        return self._upcoming(reversed(self.order[:index]), live_numel)

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

    def _upcoming(self, candidates: object, live_numel: int) -> list[ParamUnit]:
        chosen: list[ParamUnit] = []
        budget = self.prefetch_numel
        for unit in candidates:  # type: ignore[attr-defined]
            need = unit.sharded_numel()
            if need == 0 or unit.prefetch_hold:
                continue
            if need > budget or live_numel + need > self.max_live_numel:
                break
            budget -= need
            live_numel += need
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
