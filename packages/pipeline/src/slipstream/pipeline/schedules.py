"""Pipeline schedules as data: one list of instructions per pipeline rank.

A schedule says, for each rank, in which order to run forward and backward passes of which
micro-batch on which model chunk, and where activations and gradients are sent and received.
It holds no tensors and runs nothing: :mod:`slipstream.pipeline.executor` interprets it, and
:func:`simulate` replays it with a cost model to check it (every forward before its
backward, sends matching receives in order, no deadlock) and to measure its bubble.

Model layout: with ``P`` ranks and ``v`` chunks per rank the model has ``S = P·v`` parts;
part ``s`` lives on rank ``s % P`` as chunk ``s // P`` (Megatron's interleaving). Activations
flow from part ``s`` to ``s + 1``, gradients back.

[Note: communication placement] Compute orders are built first; communication is then
inserted mechanically: a receive just before the compute that needs it, a send just after
the compute that produces it. Sends are asynchronous (``isend``) and receives block, so a
schedule is deadlock-free exactly when this replay finishes, which :func:`simulate` checks.
Each (sender, receiver, kind) channel must also deliver messages in the order the receiver
asks for them, because NCCL matches point-to-point messages by order, not by tag.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "SCHEDULES",
    "Instruction",
    "Op",
    "PipelineSchedule",
    "ScheduleError",
    "SimulationResult",
    "build_schedule",
    "canonical_schedule_name",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "simulate",
    "theoretical_bubble_fraction",
    "zero_bubble",
]


class Op(enum.Enum):
    """What an instruction does."""

    FORWARD = "F"
    BACKWARD = "B"  # input and weight gradients together
    BACKWARD_INPUT = "Bi"  # gradient w.r.t. the part's input only (zero-bubble)
    BACKWARD_WEIGHT = "W"  # gradient w.r.t. the weights, after BACKWARD_INPUT (zero-bubble)
    SEND_ACTIVATION = "SA"
    RECV_ACTIVATION = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"

    @property
    def is_compute(self) -> bool:
        """Whether the op runs the model (as opposed to moving data)."""
        return self in _COMPUTE


_COMPUTE = frozenset({Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT})


@dataclasses.dataclass(frozen=True, slots=True)
class Instruction:
    """One step of a rank's schedule: ``op`` on ``microbatch`` for model ``chunk``."""

    op: Op
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        suffix = f".{self.chunk}" if self.chunk else ""
        return f"{self.op.value}{self.microbatch}{suffix}"


class ScheduleError(ValueError):
    """A schedule is invalid: a backward before its forward, unmatched messages, a deadlock."""


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """Instruction lists for every rank of one pipeline, for one batch.

    Attributes:
        name: the schedule's name (``"1f1b"``, ...).
        num_stages: pipeline ranks ``P``.
        num_microbatches: micro-batches ``M`` per batch.
        virtual_stages: chunks ``v`` per rank.
        stages: ``stages[r]`` is rank ``r``'s instruction list.
        train: False for a forward-only (evaluation) schedule.

    >>> schedule = one_f_one_b(num_stages=2, num_microbatches=2)
    >>> schedule.stages[0]
    (F0, SA0, F1, SA1, RG0, B0, RG1, B1)
    >>> schedule.stages[1]
    (RA0, F0, B0, SG0, RA1, F1, B1, SG1)
    """

    name: str
    num_stages: int
    num_microbatches: int
    virtual_stages: int
    stages: tuple[tuple[Instruction, ...], ...]
    train: bool = True

    @property
    def num_parts(self) -> int:
        """Model parts ``P · v``."""
        return self.num_stages * self.virtual_stages

    def part(self, rank: int, chunk: int) -> int:
        """The model part that ``chunk`` on ``rank`` holds."""
        return chunk * self.num_stages + rank

    def compute_order(self, rank: int) -> list[Instruction]:
        """Rank ``rank``'s compute instructions only, in order."""
        return [i for i in self.stages[rank] if i.op.is_compute]

    def describe(self) -> str:
        """The schedule as text, one rank per line."""
        lines = [
            f"{self.name}: P={self.num_stages} M={self.num_microbatches} v={self.virtual_stages}"
        ]
        for rank, instructions in enumerate(self.stages):
            lines.append(f"  rank {rank}: " + " ".join(repr(i) for i in instructions))
        return "\n".join(lines)


def _check_sizes(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> None:
    if num_stages < 1 or num_microbatches < 1 or virtual_stages < 1:
        raise ValueError(
            f"num_stages={num_stages}, num_microbatches={num_microbatches} and "
            f"virtual_stages={virtual_stages} must all be >= 1"
        )


def _with_communication(
    name: str,
    orders: Sequence[Sequence[Instruction]],
    num_microbatches: int,
    virtual_stages: int,
    train: bool = True,
) -> PipelineSchedule:
    """Insert receives before and sends after each compute instruction (see the module note)."""
    num_stages = len(orders)
    last_part = num_stages * virtual_stages - 1
    stages = []
    for rank, order in enumerate(orders):
        out: list[Instruction] = []
        for ins in order:
            part = ins.chunk * num_stages + rank
            if ins.op is Op.FORWARD:
                if part > 0:
                    out.append(Instruction(Op.RECV_ACTIVATION, ins.microbatch, ins.chunk))
                out.append(ins)
                if part < last_part:
                    out.append(Instruction(Op.SEND_ACTIVATION, ins.microbatch, ins.chunk))
            elif ins.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                if part < last_part:
                    out.append(Instruction(Op.RECV_GRAD, ins.microbatch, ins.chunk))
                out.append(ins)
                if part > 0:
                    out.append(Instruction(Op.SEND_GRAD, ins.microbatch, ins.chunk))
            else:
                out.append(ins)
        stages.append(tuple(out))
    return PipelineSchedule(
        name, num_stages, num_microbatches, virtual_stages, tuple(stages), train=train
    )


def forward_only(
    num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> PipelineSchedule:
    """Evaluation: every micro-batch forward through every chunk, in order.

    >>> forward_only(2, 2).stages[1]
    (RA0, F0, RA1, F1)
    """
    _check_sizes(num_stages, num_microbatches, virtual_stages)
    orders = []
    for _rank in range(num_stages):
        order = [
            Instruction(Op.FORWARD, m, c)
            for m in range(num_microbatches)
            for c in range(virtual_stages)
        ]
        orders.append(order)
    if virtual_stages > 1:
        # Chunk c of micro-batch m needs chunk c-1 from the last rank: run chunk by chunk.
        orders = [
            [
                Instruction(Op.FORWARD, m, c)
                for c in range(virtual_stages)
                for m in range(num_microbatches)
            ]
            for _ in range(num_stages)
        ]
    return _with_communication(
        "forward_only", orders, num_microbatches, virtual_stages, train=False
    )


def gpipe(num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """GPipe: all forwards, then all backwards. Activation memory grows with ``M``.

    >>> gpipe(2, 2).compute_order(0)
    [F0, F1, B0, B1]
    """
    _check_sizes(num_stages, num_microbatches)
    orders = [
        [Instruction(Op.FORWARD, m) for m in range(num_microbatches)]
        + [Instruction(Op.BACKWARD, m) for m in range(num_microbatches)]
        for _ in range(num_stages)
    ]
    return _with_communication("gpipe", orders, num_microbatches, 1)


def one_f_one_b(num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """1F1B (PipeDream-flush, DeepSpeed's schedule): ``P - r - 1`` warm-up forwards, then
    alternate one forward and one backward; at most ``P - r`` micro-batches in flight.

    >>> one_f_one_b(3, 4).compute_order(0)
    [F0, F1, F2, B0, F3, B1, B2, B3]
    """
    _check_sizes(num_stages, num_microbatches)
    orders = []
    for rank in range(num_stages):
        warmup = min(num_stages - rank - 1, num_microbatches)
        order = [Instruction(Op.FORWARD, m) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            order.append(Instruction(Op.FORWARD, warmup + i))
            order.append(Instruction(Op.BACKWARD, i))
        order += [
            Instruction(Op.BACKWARD, m) for m in range(num_microbatches - warmup, num_microbatches)
        ]
        orders.append(order)
    return _with_communication("1f1b", orders, num_microbatches, 1)


def interleaved_1f1b(
    num_stages: int, num_microbatches: int, virtual_stages: int
) -> PipelineSchedule:
    """Interleaved 1F1B (Megatron-LM): each rank holds ``v`` chunks, shrinking the bubble by
    ``v`` at the price of ``v`` times more point-to-point messages.

    Micro-batches go through in groups of ``P``, so ``M`` must be a multiple of ``P``.

    >>> interleaved_1f1b(2, 4, 2).compute_order(1)
    [F0, F1, F0.1, B0.1, F1.1, B1.1, F2, B0, F3, B1, F2.1, B2.1, F3.1, B3.1, B2, B3]
    """
    _check_sizes(num_stages, num_microbatches, virtual_stages)
    p, m_total, v = num_stages, num_microbatches, virtual_stages
    if m_total % p:
        raise ValueError(
            f"interleaved 1F1B needs the micro-batch count ({m_total}) to be a multiple of the "
            f"pipeline depth ({p}); change gradient_accumulation_steps"
        )
    total = m_total * v

    def forward_at(k: int) -> Instruction:
        chunk = (k // p) % v
        return Instruction(Op.FORWARD, (k // (p * v)) * p + k % p, chunk)

    def backward_at(k: int) -> Instruction:
        chunk = v - 1 - (k // p) % v
        return Instruction(Op.BACKWARD, (k // (p * v)) * p + k % p, chunk)

    orders = []
    for rank in range(p):
        if m_total == p:
            warmup = total  # too few micro-batches for a steady state: all forwards first
        else:
            warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
        order = [forward_at(k) for k in range(warmup)]
        for k in range(total - warmup):
            order.append(forward_at(warmup + k))
            order.append(backward_at(k))
        order += [backward_at(k) for k in range(total - warmup, total)]
        orders.append(order)
    return _with_communication("interleaved_1f1b", orders, m_total, v)


def zero_bubble(num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """Zero-bubble pipeline, ZB-H1 (Qi et al., 2023): backward split into an input-gradient
    pass (on the critical path, sent upstream at once) and a weight-gradient pass that fills
    the bubbles, with 1F1B's peak activation memory: rank ``r`` keeps at most ``P - r``
    micro-batches between forward and input-gradient pass (as 1F1B) and at most ``P``
    between forward and weight pass (1F1B's peak, reached on rank 0).

    The order comes from a list scheduler on unit costs (forward = input-grad = weight-grad =
    1): whenever a rank is free it runs a forward the memory limits allow, else a ready
    input-gradient pass, else a pending weight-gradient pass. For ``M >= P`` its bubble is
    ZB-H1's ``(P-1)/(3M+P-1)``, a third of 1F1B's in time.

    >>> zero_bubble(2, 3).compute_order(1)
    [F0, Bi0, F1, Bi1, W0, F2, Bi2, W1, W2]
    """
    _check_sizes(num_stages, num_microbatches)
    p, m_total = num_stages, num_microbatches
    # arrival[kind][rank][m]: the tick from which the input of that pass is available.
    act_ready = [[0 if r == 0 else None for _ in range(m_total)] for r in range(p)]
    grad_ready: list[list[int | None]] = [[None] * m_total for _ in range(p)]
    next_f = [0] * p
    next_b = [0] * p
    pending_w: list[deque[int]] = [deque() for _ in range(p)]
    done_w = [0] * p
    orders: list[list[Instruction]] = [[] for _ in range(p)]
    tick = 0
    while any(done_w[r] < m_total for r in range(p)):
        finished: list[tuple[str, int, int]] = []
        for r in range(p):
            b, f = next_b[r], next_f[r]
            act_at = act_ready[r][f] if f < m_total else None
            memory_allows = f - b < p - r and f - done_w[r] < p
            if act_at is not None and act_at <= tick and memory_allows:
                orders[r].append(Instruction(Op.FORWARD, f))
                next_f[r] += 1
                finished.append(("F", r, f))
                continue
            grad_at = grad_ready[r][b] if b < m_total else None
            if b < f and grad_at is not None and grad_at <= tick:
                orders[r].append(Instruction(Op.BACKWARD_INPUT, b))
                next_b[r] += 1
                pending_w[r].append(b)
                finished.append(("B", r, b))
                continue
            if pending_w[r]:
                orders[r].append(Instruction(Op.BACKWARD_WEIGHT, pending_w[r].popleft()))
                done_w[r] += 1
        tick += 1
        # Results of this tick's passes are usable from the next tick on.
        for kind, r, m in finished:
            if kind == "F":
                if r + 1 < p:
                    act_ready[r + 1][m] = tick
                else:
                    grad_ready[r][m] = tick  # the last stage starts its backward from the loss
            elif r > 0:
                grad_ready[r - 1][m] = tick
        if tick > 10 * (m_total + p) * 3:
            raise RuntimeError("zero_bubble list scheduler made no progress (a bug)")
    return _with_communication("zero_bubble", orders, m_total, 1)


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


def canonical_schedule_name(name: str) -> str:
    """The :data:`SCHEDULES` entry that ``name`` (or an alias such as ``"zb"``) means.

    >>> canonical_schedule_name("ZB-H1")
    'zero_bubble'
    """
    key = name.lower().replace("-", "_")
    if key in ("1f1b", "one_f_one_b", "pipedream_flush"):
        return "1f1b"
    if key in ("interleaved", "interleaved_1f1b"):
        return "interleaved_1f1b"
    if key in ("zero_bubble", "zb", "zbh1", "zb_h1"):
        return "zero_bubble"
    if key in ("gpipe", "fill_drain"):
        return "gpipe"
    raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def build_schedule(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> PipelineSchedule:
    """The schedule called ``name`` (one of :data:`SCHEDULES`).

    >>> build_schedule("1f1b", 4, 8).name
    '1f1b'
    """
    builder = canonical_schedule_name(name)
    if builder != "interleaved_1f1b" and virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} runs one chunk per rank but virtual_stages={virtual_stages}; "
            "use 'interleaved_1f1b' or virtual_stages=1"
        )
    if builder == "1f1b":
        return one_f_one_b(num_stages, num_microbatches)
    if builder == "gpipe":
        return gpipe(num_stages, num_microbatches)
    if builder == "zero_bubble":
        return zero_bubble(num_stages, num_microbatches)
    return interleaved_1f1b(num_stages, num_microbatches, virtual_stages)


# ---------------------------------------------------------------------- simulation

DEFAULT_COSTS: Mapping[Op, float] = {
    Op.FORWARD: 1.0,
    Op.BACKWARD: 2.0,
    Op.BACKWARD_INPUT: 1.0,
    Op.BACKWARD_WEIGHT: 1.0,
}


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` measured.

    Attributes:
        makespan: time from the first instruction to the last rank's end.
        busy: per rank, the time spent computing.
        start_times: per rank, the start time of each compute instruction (in list order).
    """

    makespan: float
    busy: tuple[float, ...]
    start_times: tuple[tuple[float, ...], ...]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the total rank-time: ``1 - Σ busy / (P · makespan)``."""
        if self.makespan == 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def _peer(schedule: PipelineSchedule, rank: int, ins: Instruction) -> tuple[int, int]:
    """(rank, chunk) at the other end of a send or receive."""
    part = schedule.part(rank, ins.chunk)
    other = part + 1 if ins.op in (Op.SEND_ACTIVATION, Op.RECV_GRAD) else part - 1
    return other % schedule.num_stages, other // schedule.num_stages


def simulate(
    schedule: PipelineSchedule, costs: Mapping[Op, float] | None = None
) -> SimulationResult:
    """Replay a schedule with compute ``costs`` (per full-model-part pass; a chunk costs
    ``1/v`` of it) and free, asynchronous sends; raise :class:`ScheduleError` if it is invalid.

    Checks: each (micro-batch, chunk) is run forward once, then backward (or input-gradient
    then weight-gradient) once on a training schedule; a pass finds its input received; every
    receive gets the message its channel delivers next (FIFO per sender, receiver and kind);
    no message is left unreceived; and the replay cannot deadlock.

    >>> round(simulate(one_f_one_b(4, 8)).bubble_fraction, 4)
    0.2727
    """
    costs = dict(DEFAULT_COSTS if costs is None else costs)
    p, v, m_total = schedule.num_stages, schedule.virtual_stages, schedule.num_microbatches
    if len(schedule.stages) != p:
        raise ScheduleError(f"{len(schedule.stages)} instruction lists for {p} stages")
    last_part = schedule.num_parts - 1
    channels: dict[tuple[int, int, str], deque[tuple[int, int, float]]] = {}
    position = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    starts: list[list[float]] = [[] for _ in range(p)]
    # Per rank: which (m, chunk) have their input, ran forward, have the output grad, ...
    has_input: list[set[tuple[int, int]]] = [set() for _ in range(p)]
    forwarded: list[set[tuple[int, int]]] = [set() for _ in range(p)]
    has_grad: list[set[tuple[int, int]]] = [set() for _ in range(p)]
    input_grad_done: list[set[tuple[int, int]]] = [set() for _ in range(p)]
    weight_done: list[set[tuple[int, int]]] = [set() for _ in range(p)]

    def fail(rank: int, ins: Instruction, why: str) -> ScheduleError:
        return ScheduleError(
            f"{schedule.name}: rank {rank} instruction {position[rank]} ({ins!r}): {why}"
        )

    progressed = True
    while progressed:
        progressed = False
        for rank in range(p):
            while position[rank] < len(schedule.stages[rank]):
                ins = schedule.stages[rank][position[rank]]
                key = (ins.microbatch, ins.chunk)
                if not (0 <= ins.microbatch < m_total and 0 <= ins.chunk < v):
                    raise fail(rank, ins, "micro-batch or chunk out of range")
                part = schedule.part(rank, ins.chunk)
                if ins.op in (Op.RECV_ACTIVATION, Op.RECV_GRAD):
                    src, src_chunk = _peer(schedule, rank, ins)
                    kind = "act" if ins.op is Op.RECV_ACTIVATION else "grad"
                    queue = channels.get((src, rank, kind))
                    if not queue:
                        break  # blocked until the sender gets there
                    m, chunk, sent_at = queue.popleft()
                    if (m, chunk) != (ins.microbatch, src_chunk):
                        raise fail(
                            rank,
                            ins,
                            f"the channel from rank {src} delivers {kind} of micro-batch {m} "
                            f"chunk {chunk} next, not micro-batch {ins.microbatch} chunk "
                            f"{src_chunk}: sends and receives are out of order",
                        )
                    clock[rank] = max(clock[rank], sent_at)
                    (has_input if kind == "act" else has_grad)[rank].add(key)
                elif ins.op in (Op.SEND_ACTIVATION, Op.SEND_GRAD):
                    dst, _ = _peer(schedule, rank, ins)
                    kind = "act" if ins.op is Op.SEND_ACTIVATION else "grad"
                    ready = forwarded if kind == "act" else input_grad_done
                    if key not in ready[rank]:
                        raise fail(rank, ins, f"sends the {kind} of a pass that has not run")
                    if (kind == "act" and part == last_part) or (kind == "grad" and part == 0):
                        raise fail(rank, ins, "sends past the end of the pipeline")
                    channels.setdefault((rank, dst, kind), deque()).append(
                        (ins.microbatch, ins.chunk, clock[rank])
                    )
                else:
                    if ins.op is Op.FORWARD:
                        if part > 0 and key not in has_input[rank]:
                            raise fail(rank, ins, "forward before its activation was received")
                        if key in forwarded[rank]:
                            raise fail(rank, ins, "forward run twice")
                        forwarded[rank].add(key)
                    elif ins.op in (Op.BACKWARD, Op.BACKWARD_INPUT):
                        if not schedule.train:
                            raise fail(rank, ins, "backward in a forward-only schedule")
                        if key not in forwarded[rank]:
                            raise fail(rank, ins, "backward before its forward")
                        if part < last_part and key not in has_grad[rank]:
                            raise fail(rank, ins, "backward before its gradient was received")
                        if key in input_grad_done[rank]:
                            raise fail(rank, ins, "backward run twice")
                        input_grad_done[rank].add(key)
                        if ins.op is Op.BACKWARD:
                            weight_done[rank].add(key)
                    else:
                        if key not in input_grad_done[rank] or key in weight_done[rank]:
                            raise fail(
                                rank, ins, "weight-gradient pass without its input-gradient pass"
                            )
                        weight_done[rank].add(key)
                    cost = costs[ins.op] / v
                    starts[rank].append(clock[rank])
                    clock[rank] += cost
                    busy[rank] += cost
                position[rank] += 1
                progressed = True
    stuck = [
        f"rank {r} at {schedule.stages[r][position[r]]!r}"
        for r in range(p)
        if position[r] < len(schedule.stages[r])
    ]
    if stuck:
        raise ScheduleError(f"{schedule.name} deadlocks: " + "; ".join(stuck))
    leftover = [f"{src}->{dst} {kind}" for (src, dst, kind), q in channels.items() if q]
    if leftover:
        raise ScheduleError(f"{schedule.name}: messages never received on {leftover}")
    expected = {(m, c) for m in range(m_total) for c in range(v)}
    for rank in range(p):
        if forwarded[rank] != expected:
            raise ScheduleError(f"{schedule.name}: rank {rank} misses forwards")
        if schedule.train and weight_done[rank] != expected:
            raise ScheduleError(f"{schedule.name}: rank {rank} misses backward passes")
    return SimulationResult(max(clock), tuple(busy), tuple(tuple(s) for s in starts))


def theoretical_bubble_fraction(
    name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> float:
    """The bubble the literature gives for a schedule, with forward = 1 and backward = 2
    (input-gradient = weight-gradient = 1) per model part, and free communication.

    GPipe and 1F1B: ``(P-1)/(M+P-1)``; interleaved: ``(P-1)/(v·M+P-1)``; ZB-H1:
    ``(P-1)/(3M+P-1)`` (derived for ``M >= P``; with fewer micro-batches the input-gradient
    chain is exposed and no schedule reaches it).

    >>> theoretical_bubble_fraction("1f1b", 4, 8)
    0.2727272727272727
    """
    p, m, v = num_stages, num_microbatches, virtual_stages
    key = canonical_schedule_name(name)
    if key in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if key == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (3 * m + p - 1)


def all_instructions(schedule: PipelineSchedule) -> Iterable[tuple[int, Instruction]]:
    """Every (rank, instruction) of a schedule."""
    for rank, instructions in enumerate(schedule.stages):
        for ins in instructions:
            yield rank, ins
