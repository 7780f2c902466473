"""Where a training step's peak GPU memory comes from: allocated bytes at phase boundaries.

``MemoryTimeline.mark(phase)`` closes a phase: it records the bytes allocated at that point and
the peak reached since the previous mark (``torch.cuda.max_memory_allocated``, reset at each
mark), so a step split into forward / backward / step says which phase holds the peak and by how
much it rises over what persists. ``state_bytes`` splits what persists between steps into model
states (parameters, master shards, gradients, optimizer states) for Slipstream, FSDP2 and DDP
(each storage counted once). ``train_bench.py --memory-phases`` runs one instrumented step after
the timed ones and adds both to its ``BENCH`` line; ``--memory-snapshot PATH`` also dumps rank 0's
allocator history of that step for https://pytorch.org/memory_viz.

Read a results file written by ``run_all.py`` / ``train_bench.py --out``::

    python tools/bench/memory_timeline.py bench-results.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

GIB = 2**30


class MemoryTimeline:
    """Allocated and peak device bytes per phase (all zeros on a CPU device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.phases: list[dict[str, Any]] = []
        if self.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        self.start = self._allocated()

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def mark(self, phase: str) -> None:
        """End ``phase``: record the allocated bytes now and the peak since the last mark."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) if self.cuda else 0
        end = self._allocated()
        self.phases.append({"phase": phase, "end_gib": end / GIB, "peak_gib": peak / GIB})
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def summary(self) -> dict[str, Any]:
        """``{"start_gib", "phases": [...], "peak_phase", "peak_gib"}``, rounded to 0.01 GiB."""
        phases = [
            {k: round(v, 2) if isinstance(v, float) else v for k, v in p.items()}
            for p in self.phases
        ]
        top = max(phases, key=lambda p: p["peak_gib"], default=None)
        return {
            "start_gib": round(self.start / GIB, 2),
            "phases": phases,
            "peak_phase": None if top is None else top["phase"],
            "peak_gib": None if top is None else top["peak_gib"],
        }


def _storages(groups: Iterable[tuple[str, Iterable[Any]]]) -> dict[str, float]:
    """GiB per group; a storage already counted in an earlier group is not counted again."""
    seen: set[int] = set()
    out: dict[str, float] = {}
    for name, tensors in groups:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            local = getattr(t, "_local_tensor", t)  # a DTensor (FSDP2): its local shard
            storage = local.untyped_storage()
            key = storage.data_ptr()
            if not storage.nbytes() or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        out[name] = round(total / GIB, 2)
    return out


def _optimizer_states(optimizer: Any) -> list[torch.Tensor]:
    state = getattr(optimizer, "state", {})
    return [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def state_bytes(engine_or_model: Any, optimizer: Any = None) -> dict[str, float]:
    """GiB of the model states this rank holds now, by kind.

    A Slipstream engine: its gradient path's masters (the stage-3 shards when they are the
    masters), master grads, optimizer states, stage-3 shards that are not masters, gathered
    parameters and the reducer's live buffers. Otherwise (FSDP2, DDP) ``engine_or_model``'s
    parameters and grads and ``optimizer``'s states.
    """
    path = getattr(engine_or_model, "zero", None)
    masters = getattr(path, "masters", None)
    if path is not None and masters is not None:
        inner = getattr(path.optimizer, "optimizer", path.optimizer)
        stage3 = getattr(path, "model", None)
        shards = [s.shard for s in getattr(stage3, "sharded", [])]
        module = getattr(engine_or_model, "module", None)
        params = list(module.parameters()) if module is not None else []
        result = _storages(
            [
                ("masters", masters.masters),
                ("master_grads", [masters.grad(i) for i in range(len(masters))]),
                ("optimizer_states", _optimizer_states(inner)),
                ("other_shards", shards),
                ("params", params),
                ("param_grads", [p.grad for p in params]),
            ]
        )
        reducer = getattr(path, "reducer", None)
        if reducer is not None and hasattr(reducer, "live_bytes"):
            result["reduce_buffers"] = round(reducer.live_bytes() / GIB, 2)
        # The copy-engine publish's symmetric buffer (counted in "params" above): outside the
        # caching allocator, so the phases' allocated and peak figures leave it out.
        report = path.memory_report() if hasattr(path, "memory_report") else {}
        if report.get("publish_buffer_cuda"):
            result["params_outside_allocator"] = round(report["publish_buffer_cuda"] / GIB, 2)
        return result
    params = list(engine_or_model.parameters())
    return _storages(
        [
            ("params", params),
            ("param_grads", [p.grad for p in params]),
            ("optimizer_states", _optimizer_states(optimizer)),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Print each result's per-phase memory from a ``BENCH`` results file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    args = parser.parse_args(argv)
    for line in args.results.read_text().splitlines():
        r = json.loads(line)
        memory = r.get("memory_phases")
        if not memory:
            continue
        symmetric = r.get("symmetric_gib") or 0.0
        beside = f" (+ {symmetric} GiB symmetric buffer, not in the allocator)" if symmetric else ""
        print(f"{r['impl']} {r['model']}/{r['micro']}: peak {r['peak_alloc_gib']} GiB{beside}")
        print(f"  between steps {memory['start_gib']} GiB: {r.get('memory_states', {})}")
        for p in memory["phases"]:
            mark = " <- peak" if p["phase"] == memory["peak_phase"] else ""
            print(f"  {p['phase']:>8}: peak {p['peak_gib']:6.2f}  end {p['end_gib']:6.2f}{mark}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
