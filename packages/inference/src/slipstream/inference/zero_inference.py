"""ZeRO-Inference: block weights live in (pinned) host memory or on NVMe and stream to the device.

While block ``i`` computes, block ``i + 1``'s weights copy to the device on a side stream, so the
copy overlaps compute. When every block has the same tensor shapes (every supported decoder),
the copies land in a ring of two preallocated device buffer sets (double buffering): a set is
refilled once the block that used it is done (a CUDA event, no host wait), so the device holds
two blocks at most, the caching allocator is never asked for block-sized memory during a pass,
and the host may run ahead. Only the embedding, the final norm and the LM head stay resident. With NVMe, each block's host tensors
are swap files of ``slipstream.offload``'s ``ParamSwapStore`` (asynchronous direct I/O): block
``i + 2``'s read from disk is started just before block ``i + 1`` is copied to the device (the
read overlaps the copy), and a block's host memory is freed again as soon as its device copy is
made.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slipstream.inference.model import FusedDecoder, LayerHook

__all__ = ["RING_DEPTH", "LayerStreamer", "offload_decoder"]

RING_DEPTH = 2  # device buffer sets of the double-buffered stream (one computing, one filling)


def _tensors(block: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of a block (quantized codes and scales are buffers)."""
    return [*block.parameters(), *block.buffers()]


class LayerStreamer(LayerHook):
    """Moves each block's weights host -> device before it runs, one block ahead (prefetch).

    ``fetches`` counts the block copies made, for tests and logs.
    """

    def __init__(
        self,
        blocks: nn.ModuleList,
        device: torch.device,
        pin_memory: bool,
        store: Any = None,
    ) -> None:
        self.device = device
        self.slots = [_tensors(block) for block in blocks]
        self.store = store  # a slipstream.offload.ParamSwapStore: the host tensors on NVMe
        pin = pin_memory and device.type == "cuda" and store is None
        self.host: list[list[torch.Tensor]] = []
        for index, tensors in enumerate(self.slots):
            copies = []
            for number, tensor in enumerate(tensors):
                if store is not None:  # a tensor owning its storage, swapped out to a file
                    host = torch.empty(tensor.shape, dtype=tensor.dtype)
                    host.copy_(tensor.detach())
                    store.register(f"block{index}.{number}", host)
                else:
                    host = tensor.detach().to("cpu")
                    host = host.pin_memory() if pin else host
                copies.append(host)
                tensor.data = host
            self.host.append(copies)
        if store is not None:
            store.finish()  # every swap file written; the host memory beyond max_in_cpu freed
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready: dict[int, tuple[list[torch.Tensor], torch.cuda.Event | None]] = {}
        self.fetches = 0
        # Double buffering: RING_DEPTH device buffer sets, used in turn (by fetch count, so
        # that the last block and the first of the next pass never share one).
        self.ring: list[list[torch.Tensor]] = []
        self.ring_free: list[torch.cuda.Event | None] = []
        self.in_ring: dict[int, int] = {}  # block index -> the ring set it is using
        layout = [(t.shape, t.dtype) for t in self.host[0]] if self.host else []
        same = all([(t.shape, t.dtype) for t in h] == layout for h in self.host)
        if store is None and len(self.host) >= RING_DEPTH and same:
            self.ring = [
                [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in layout]
                for _ in range(RING_DEPTH)
            ]
            self.ring_free = [None] * RING_DEPTH

    def _fetch(self, index: int) -> None:
        index %= len(self.slots)
        if index in self.ready:
            return
        self.fetches += 1
        if self.store is not None:
            self.store.ensure(self.host[index])  # read from disk (usually already started)
            if len(self.slots) > 1:
                # The next block's read runs while this one is copied to the device.
                self.store.prefetch(self.host[(index + 1) % len(self.slots)])
            # Pageable host memory: the copies below have consumed it when they return, so the
            # memory can be freed (a clean release: the swap file holds the same bytes).
            copies = [h.to(self.device, copy=True) for h in self.host[index]]
            self.store.release(self.host[index], dirty=False)
            event = None
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
            self.ready[index] = (copies, event)
            return
        if self.ring:
            slot = (self.fetches - 1) % RING_DEPTH
            self.in_ring[index] = slot
            targets = self.ring[slot]
            free = self.ring_free[slot]
            if self.stream is None:  # CPU: the same path, synchronous
                for target, host in zip(targets, self.host[index]):
                    target.copy_(host)
                self.ready[index] = (targets, None)
                return
            if free is not None:
                self.stream.wait_event(free)  # the block that last used this set is done
            with torch.cuda.stream(self.stream):
                for target, host in zip(targets, self.host[index]):
                    target.copy_(host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.ready[index] = (targets, event)
            return
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
            for copy in [] if self.ring else copies:
                # Allocated on the side stream, used on this one: keep the allocator from
                # handing the memory out again before this stream is done with it.
                copy.record_stream(current)
        for tensor, copy in zip(self.slots[index], copies):
            tensor.data = copy
        self._fetch(index + 1)  # overlaps the next block's copy with this block's compute

    def after(self, index: int) -> None:
        for tensor, host in zip(self.slots[index], self.host[index]):
            tensor.data = host
        slot = self.in_ring.pop(index, None)
        if slot is not None and self.stream is not None:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.ring_free[slot] = done


def offload_decoder(
    model: FusedDecoder,
    device: torch.device,
    *,
    pin_memory: bool = True,
    nvme_path: str | None = None,
    max_in_cpu: int = 0,
) -> None:
    """Keep ``model``'s blocks in host memory (or in swap files under ``nvme_path``, all but
    the first ``max_in_cpu`` elements), streamed to ``device`` layer by layer."""
    store = None
    if nvme_path is not None:
        try:
            from slipstream.offload import AioSettings, AsyncIOEngine, ParamSwapStore, SwapSpace
        except ImportError as error:
            raise ImportError(
                'zero.offload_param.device="nvme" needs slipstream-offload-io '
                "(pip install slipstream-offload-io)"
            ) from error
        space = SwapSpace(nvme_path, AsyncIOEngine(AioSettings()), name="inference")
        store = ParamSwapStore(space, max_in_cpu)
    streamer = LayerStreamer(model.blocks, device, pin_memory, store)
    for name, module in model.named_children():
        if name != "blocks":
            module.to(device)
    model.inv_freq = model.inv_freq.to(device)
    model.layer_hook = streamer
