"""ParamUnit: the parameters one module needs, gathered and released together."""

from __future__ import annotations

import torch

from slipstream.zero.stage3.sharded_param import PendingGather, ShardedParameter, gather_full
from slipstream.zero.stage3.state import ShardState, TrainingState

__all__ = ["ParamUnit"]


class ParamUnit:
    """The parameters a module reads (its own, plus registered external ones), as one group.

    One all-gather brings in every member that is not already gathered; releasing drops this
    unit's hold on each member, and a member whose holders reach zero is freed (unless it is
    persistent). A parameter may belong to several units (tied weights, external
    parameters); its gradient is reduced once, through its *owner* (the first module that
    registered it), and ``owned_trainable`` is what this unit waits for in backward.

    Holds: each forward call takes one (released by its post-forward hook); a prefetch takes
    one that the next forward or backward use adopts; backward takes one at the first
    gradient reaching an output and releases it once all owned gradients are in.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        name: str,
        members: list[ShardedParameter],
        leaf: bool = False,
    ) -> None:
        """``leaf``: the module is a ZeRO-3 leaf (its subtree's parameters, owned by it)."""
        self.module = module
        self.name = name
        self.leaf = leaf
        self.members: list[ShardedParameter] = []
        self.owned_trainable: set[int] = set()
        self.state = TrainingState.IDLE
        self.backward_hold = False
        self.prefetch_hold = False
        self.grads_ready = 0
        self._pending: list[PendingGather] = []
        self._holds = 0
        for member in members:
            self.add_member(member)

    def add_member(self, member: ShardedParameter) -> None:
        """Add a parameter this module reads (no-op if already a member)."""
        if all(m is not member for m in self.members):
            self.members.append(member)
            if self.holds_now:
                member.holders += 1
                self._pending.extend(gather_full([member]))
                self._wait()

    @property
    def holds_now(self) -> int:
        """How many holds this unit has on its members (forward calls, backward, prefetch)."""
        return self._holds

    @property
    def numel(self) -> int:
        """Elements of all members, full size."""
        return sum(m.full_numel for m in self.members)

    def sharded_numel(self) -> int:
        """Elements that a gather of this unit would bring in now."""
        return sum(m.full_numel for m in self.members if m.state is ShardState.SHARDED)

    # ------------------------------------------------------------------ holds
    def _take(self) -> None:
        self._holds += 1
        for member in self.members:
            member.holders += 1

    def _wait(self) -> None:
        for member in self.members:
            if member.pending is not None:
                member.pending.wait()
        self._pending.clear()

    def unshard(self) -> None:
        """Begin a use: make every member's full data present (adopting a prefetch)."""
        if self.prefetch_hold:
            self.prefetch_hold = False
        else:
            self._take()
            self._pending.extend(gather_full(self.members))
        self._wait()

    def prefetch(self) -> None:
        """Start gathering asynchronously for an upcoming use (no-op if already prefetched)."""
        if self.prefetch_hold:
            return
        self._take()
        self.prefetch_hold = True
        self._pending.extend(gather_full(self.members, async_op=True))

    def reshard(self) -> None:
        """End a use: drop this unit's hold; free members nobody holds (unless persistent)."""
        if self._holds == 0:
            return
        self._holds -= 1
        for member in self.members:
            member.holders -= 1
            if member.holders == 0 and not member.persistent:
                if member.pending is not None:
                    member.pending.wait()
                member.free()

    def keep_for_next_call(self) -> None:
        """End a forward call but keep the gathered data for the next call (reuse distance).

        The use's hold becomes a prefetch hold, which the next call adopts (or the end of
        the forward drops).
        """
        if self.prefetch_hold:
            self.reshard()
        else:
            self.prefetch_hold = True

    def drop_prefetch(self) -> None:
        """Release a prefetch hold that no use adopted (the recorded order was not followed)."""
        if self.prefetch_hold:
            self.prefetch_hold = False
            self._wait()
            self.reshard()

    # ------------------------------------------------------------------ backward
    def pre_backward(self) -> bool:
        """Gather for this module's backward; True if this call took the backward hold."""
        if self.backward_hold:
            return False
        self.unshard()
        self.backward_hold = True
        self.state = TrainingState.PRE_BACKWARD
        return True

    def grad_ready(self) -> None:
        """One owned gradient is in its bucket; release the backward hold when all are."""
        self.grads_ready += 1
        if self.grads_ready >= len(self.owned_trainable) and self.backward_hold:
            self.backward_hold = False
            self.state = TrainingState.POST_BACKWARD
            self.reshard()

    def end_backward(self) -> None:
        """Reset for the next iteration, releasing what this unit still holds."""
        if self.backward_hold:
            self.backward_hold = False
            self.reshard()
        self.drop_prefetch()
        self.grads_ready = 0
        self.state = TrainingState.IDLE
