"""Run one rank's instruction list of a pipeline schedule on a PipelineModule.

The executor owns the per-micro-batch buffers (inputs, outputs, losses) and turns each
instruction into a forward, a backward or a send/receive through a
:class:`~slipstream.pipeline.p2p.StageCommunicator`. It does no optimizer work: after
:meth:`PipelineExecutor.run` the gradients of this rank's parameters hold the batch's mean
gradient (each micro-batch loss is divided by the micro-batch count), not yet reduced across
tied stages or data-parallel replicas (see :mod:`slipstream.pipeline.gradients`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from slipstream.pipeline.module import PipelineModule
from slipstream.pipeline.p2p import StageCommunicator
from slipstream.pipeline.schedules import Instruction, Op, PipelineSchedule
from slipstream.pipeline.split_backward import (
    PendingWeightGradients,
    backward_input,
    backward_weight,
)

__all__ = ["PipelineExecutor", "PipelineResult"]


@dataclasses.dataclass
class PipelineResult:
    """What a batch produced on this rank.

    Attributes:
        losses: per micro-batch, the unscaled loss (detached); empty unless this rank holds
            the model's last part and losses were computed.
        outputs: per micro-batch, the last part's output (when asked for).
    """

    losses: list[torch.Tensor]
    outputs: list[Any]


@dataclasses.dataclass
class _Slot:
    """Buffers of one (micro-batch, chunk)."""

    inputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    input_value: Any = None
    outputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    loss: torch.Tensor | None = None
    output_grads: list[torch.Tensor] | None = None
    pending_weights: PendingWeightGradients | None = None

    def release(self) -> None:
        """Drop what backward needed; inputs stay until their gradient is sent."""
        self.outputs, self.output_grads, self.loss = [], None, None
        self.pending_weights = None
        if not any(t.requires_grad for t in self.inputs):
            self.inputs, self.input_value = [], None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        out = []
        for item in value:
            if not isinstance(item, torch.Tensor):
                raise TypeError(
                    "a pipeline stage must return a tensor or a tuple of tensors to pass to the "
                    f"next stage, got an element of type {type(item).__name__}"
                )
            out.append(item)
        return out
    raise TypeError(
        "a pipeline stage must return a tensor or a tuple of tensors to pass to the next "
        f"stage, got {type(value).__name__}"
    )


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value


class PipelineExecutor:
    """Interprets schedules for one rank of a pipeline.

    Args:
        module: this rank's :class:`PipelineModule`.
        communicator: moves tensors between stages (None for a single stage).
        device: where inputs are placed.
        autocast_dtype: run forwards under ``torch.autocast`` with this dtype (bf16/fp16
            mixed precision with fp32 weights, as DDP users do); None: no autocast.

    >>> executor = PipelineExecutor(module, communicator, torch.device("cpu"))  # doctest: +SKIP
    >>> result = executor.run(one_f_one_b(2, 4), iter(micro_batches))  # doctest: +SKIP
    """

    def __init__(
        self,
        module: PipelineModule,
        communicator: StageCommunicator | None,
        device: torch.device,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        self.module = module
        self.communicator = communicator
        self.device = device
        self.autocast_dtype = autocast_dtype
        #: fp16: the losses are multiplied by it before backward (the engine's loss scale).
        self.loss_scale = 1.0
        self.stage = module.stage_id
        self.num_stages = module.num_stages
        self._weights: dict[int, list[torch.Tensor]] = {}
        self._compute_loss = True
        self._num_micro = 1

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _chunk_weights(self, chunk: int) -> list[torch.Tensor]:
        """Trainable parameters this rank's ``chunk`` may use (its layers and tied modules)."""
        if chunk not in self._weights:
            params: dict[int, torch.Tensor] = {}
            for index in self.module.stage_layers(chunk):
                sub = getattr(self.module, str(index), None)
                if isinstance(sub, torch.nn.Module):
                    for p in sub.parameters():
                        params[id(p)] = p
            for p in self.module.tied_modules.parameters():
                params[id(p)] = p
            self._weights[chunk] = [p for p in params.values() if p.requires_grad]
        return self._weights[chunk]

    def run(
        self,
        schedule: PipelineSchedule,
        data_iter: Iterator[Any] | None,
        *,
        compute_loss: bool = True,
        return_outputs: bool = False,
        after_weight_gradients: Callable[[int, int], None] | None = None,
    ) -> PipelineResult:
        """Execute this rank's instructions of ``schedule`` for one batch.

        ``data_iter`` yields ``(inputs, labels)`` per micro-batch; only the ranks holding the
        model's first part (inputs) and last part (labels) read it, others may pass None. A
        training schedule accumulates ``loss / M`` gradients into the parameters.

        ``after_weight_gradients(microbatch, chunk)`` runs after every instruction that
        accumulates weight gradients (a full backward, or the weight pass of a split one);
        ZeRO stage 2 reduce-scatters them there. The data-parallel replicas of a stage run the
        same instructions, so they call it equally often (it may issue collectives).
        """
        if (
            schedule.num_stages != self.num_stages
            or schedule.virtual_stages != self.module.num_chunks
        ):
            raise ValueError(
                f"schedule {schedule.name} is for {schedule.num_stages} stages × "
                f"{schedule.virtual_stages} chunks but the module has {self.num_stages} × "
                f"{self.module.num_chunks}"
            )
        num_micro = schedule.num_microbatches
        if (self.module.is_first_part(0) or self._holds_last_part()) and data_iter is None:
            raise ValueError(
                f"pipeline stage {self.stage} reads the data (it holds the first or last part "
                "of the model) but data_iter is None"
            )
        self._compute_loss, self._num_micro = compute_loss, num_micro
        slots: dict[tuple[int, int], _Slot] = {}
        data: dict[int, Any] = {}
        next_to_read = 0
        losses: list[torch.Tensor] = []
        outputs: list[Any] = []
        train = schedule.train

        def micro_batch(m: int) -> Any:
            # Both the first and the last part read micro-batches in order; a rank holding
            # both reads each once and keeps it until its last part has run.
            nonlocal next_to_read
            if m not in data:
                if m != next_to_read:
                    raise RuntimeError(f"micro-batch {m} requested before {next_to_read} (a bug)")
                try:
                    data[m] = next(data_iter)  # type: ignore[arg-type]
                except StopIteration:
                    raise RuntimeError(
                        f"data_iter ran out after {m} micro-batches; a batch needs "
                        f"{num_micro} (gradient_accumulation_steps)"
                    ) from None
                next_to_read += 1
            return data[m]

        if self.communicator is not None:
            self.communicator.start_batch()
        for ins in schedule.stages[self.stage]:
            slot = slots.setdefault((ins.microbatch, ins.chunk), _Slot())
            part = schedule.part(self.stage, ins.chunk)
            op = ins.op
            if op is Op.RECV_ACTIVATION:
                assert self.communicator is not None
                slot.inputs = self.communicator.recv("act", part)
                slot.input_value = slot.inputs[0] if len(slot.inputs) == 1 else tuple(slot.inputs)
            elif op is Op.SEND_ACTIVATION:
                assert self.communicator is not None
                self.communicator.send("act", part, slot.outputs)
                if not train:
                    slot.outputs = []
            elif op is Op.RECV_GRAD:
                assert self.communicator is not None
                needing = [t for t in slot.outputs if t.requires_grad]
                slot.output_grads = self.communicator.recv("grad", part, like=needing)
            elif op is Op.SEND_GRAD:
                assert self.communicator is not None
                grads = [
                    t.grad if t.grad is not None else torch.zeros_like(t)
                    for t in slot.inputs
                    if t.requires_grad
                ]
                self.communicator.send("grad", part, grads)
                slot.inputs, slot.input_value = [], None
            elif op is Op.FORWARD:
                self._forward(ins, slot, train, micro_batch, losses, outputs, return_outputs)
                if self._done_with_data(ins):
                    data.pop(ins.microbatch, None)
            elif op is Op.BACKWARD:
                self._backward(slot, weights=None)
                slot.release()
                if after_weight_gradients is not None:
                    after_weight_gradients(ins.microbatch, ins.chunk)
            elif op is Op.BACKWARD_INPUT:
                self._backward_input(slot, part, self._chunk_weights(ins.chunk))
            elif op is Op.BACKWARD_WEIGHT:
                if slot.pending_weights is not None:
                    backward_weight(slot.pending_weights)
                else:
                    self._backward(slot, weights=self._chunk_weights(ins.chunk))
                slot.release()
                if after_weight_gradients is not None:
                    after_weight_gradients(ins.microbatch, ins.chunk)
            else:  # pragma: no cover - Op is closed
                raise AssertionError(op)
        if self.communicator is not None:
            self.communicator.finish()
        return PipelineResult(losses, outputs)

    def _holds_last_part(self) -> bool:
        return self.module.is_last_part(self.module.num_chunks - 1)

    def _done_with_data(self, ins: Instruction) -> bool:
        """Whether micro-batch data is no longer needed after this forward."""
        if self._holds_last_part():
            return ins.chunk == self.module.num_chunks - 1
        return True

    def _forward(
        self,
        ins: Instruction,
        slot: _Slot,
        train: bool,
        micro_batch: Any,
        losses: list[torch.Tensor],
        outputs: list[Any],
        return_outputs: bool,
    ) -> None:
        chunk = ins.chunk
        if self.module.is_first_part(chunk):
            batch = micro_batch(ins.microbatch)
            inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
            slot.input_value = _to_device(inputs, self.device)
            slot.inputs = []
        grad_mode = torch.enable_grad() if train else torch.no_grad()
        with grad_mode, self._autocast():
            # A received activation is a leaf that collects the gradient to send upstream; the
            # stage gets a copy, so that a first layer working in place (ReLU(inplace=True))
            # does not modify a leaf that requires grad (DeepSpeed clones its inputs too).
            value = slot.input_value if not slot.inputs else _clone_leaves(slot.input_value)
            out = self.module(value, chunk=chunk)
            if self.module.is_last_part(chunk):
                if return_outputs:
                    outputs.append(_detach(out))
                # Read the micro-batch even when no loss is wanted, so that every rank's
                # data_iter advances by the same count.
                batch = micro_batch(ins.microbatch)
                if self._compute_loss or train:
                    loss = self._loss(out, batch)
                    losses.append(loss.detach())
                    if train:
                        scaled = loss if self.loss_scale == 1.0 else loss * self.loss_scale
                        slot.loss = scaled / self._num_micro
                slot.outputs = []
                return
        slot.outputs = _tensors(out)

    def _loss(self, out: Any, batch: Any) -> torch.Tensor:
        labels = batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None
        if self.module.loss_fn is not None:
            if labels is None:
                raise ValueError(
                    "the PipelineModule has a loss_fn but the micro-batch has no labels; "
                    "data_iter must yield (inputs, labels)"
                )
            loss = self.module.loss_fn(out, _to_device(labels, self.device))
        else:
            loss = out
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(
                "the pipeline's loss must be a scalar tensor; give PipelineModule a loss_fn or "
                "make the last layer return the loss"
            )
        return loss.float()

    def _backward_targets(
        self, slot: _Slot
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if slot.loss is not None:
            return [slot.loss], None
        needing = [t for t in slot.outputs if t.requires_grad]
        return needing, slot.output_grads

    def _backward(self, slot: _Slot, weights: list[torch.Tensor] | None) -> None:
        targets, grads = self._backward_targets(slot)
        if not targets:
            return
        if weights is not None:
            # The weight pass of a split backward: accumulate into the weights only (the
            # input gradients were computed and sent by BACKWARD_INPUT).
            if weights:
                torch.autograd.backward(targets, grads, inputs=weights)
        else:
            torch.autograd.backward(targets, grads)

    def _backward_input(self, slot: _Slot, part: int, weights: list[torch.Tensor]) -> None:
        needing = [t for t in slot.inputs if t.requires_grad]
        if part == 0 or not needing:
            return  # nothing to send upstream; the weight pass does all the work
        targets, grads = self._backward_targets(slot)
        # See [Note: splitting backward at the weight consumers] in split_backward.
        input_grads, slot.pending_weights = backward_input(
            targets, grads, needing, weights, split=self.module.activation_checkpoint_interval == 0
        )
        for tensor, grad in zip(needing, input_grads):
            tensor.grad = grad


def _clone_leaves(value: Any) -> Any:
    """``value`` with each leaf tensor that requires grad replaced by a clone (in the graph)."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.requires_grad and value.is_leaf else value
    if isinstance(value, (tuple, list)):
        return type(value)(_clone_leaves(v) for v in value)
    return value


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    return value
