"""ZeRO-Inference: block weights live in (pinned) host memory and stream to the device per layer.

While block ``i`` computes, block ``i + 1``'s weights copy to the device on a side stream, so the
copy overlaps compute; block ``i``'s device copies are dropped as soon as it is done. Only the
embedding, the final norm and the LM head stay resident.
"""

from __future__ import annotations

import torch
from torch import nn

from slipstream.inference.model import FusedDecoder, LayerHook

__all__ = ["LayerStreamer", "offload_decoder"]


def _tensors(block: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of a block (quantized codes and scales are buffers)."""
    return [*block.parameters(), *block.buffers()]


class LayerStreamer(LayerHook):
    """Moves each block's weights host -> device before it runs, one block ahead (prefetch).

    ``fetches`` counts the block copies made, for tests and logs.
    """

    def __init__(self, blocks: nn.ModuleList, device: torch.device, pin_memory: bool) -> None:
        self.device = device
        self.slots = [_tensors(block) for block in blocks]
        pin = pin_memory and device.type == "cuda"
        self.host: list[list[torch.Tensor]] = []
        for tensors in self.slots:
            copies = []
            for tensor in tensors:
                host = tensor.detach().to("cpu")
                copies.append(host.pin_memory() if pin else host)
                tensor.data = copies[-1]
            self.host.append(copies)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready: dict[int, tuple[list[torch.Tensor], torch.cuda.Event | None]] = {}
        self.fetches = 0

    def _fetch(self, index: int) -> None:
        index %= len(self.slots)
        if index in self.ready:
            return
        self.fetches += 1
        if self.stream is None:
            # On the CPU the "device" copy is a real copy too, so the path is the same as on GPUs.
            self.ready[index] = ([h.to(self.device, copy=True) for h in self.host[index]], None)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copies = [h.to(self.device, non_blocking=True) for h in self.host[index]]
            event = torch.cuda.Event()
            event.record(self.stream)
        self.ready[index] = (copies, event)

    def before(self, index: int) -> None:
        self._fetch(index)
        copies, event = self.ready.pop(index)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for copy in copies:
                # Allocated on the side stream, used on this one: keep the allocator from
                # handing the memory out again before this stream is done with it.
                copy.record_stream(current)
        for tensor, copy in zip(self.slots[index], copies):
            tensor.data = copy
        self._fetch(index + 1)  # overlaps the next block's copy with this block's compute

    def after(self, index: int) -> None:
        for tensor, host in zip(self.slots[index], self.host[index]):
            tensor.data = host


def offload_decoder(model: FusedDecoder, device: torch.device, *, pin_memory: bool = True) -> None:
    """Keep ``model``'s blocks in host memory, streamed to ``device`` layer by layer."""
    streamer = LayerStreamer(model.blocks, device, pin_memory)
    for name, module in model.named_children():
        if name != "blocks":
            module.to(device)
    model.inv_freq = model.inv_freq.to(device)
    model.layer_hook = streamer
