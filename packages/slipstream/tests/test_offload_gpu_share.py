"""gpu_share in training: the streamed share of each bucket reads its gradients where they were
reduced and keeps its new values on the device for the publish.

With ``offload_optimizer.gpu_share`` a share of each bucket's elements steps on the device
(StreamedAdam) during backward. That share reads the bucket's reduced gradients on the device
(lent by the reducer) instead of their host copy, and its new values, cast to the model's dtype
there, are what the publish sends for those elements instead of uploading the host master. The
run must be the run without either shortcut bit for bit (same weights, masters, Adam states and
norms after every step): with the speculative step (kept and discarded), with ``overlap_step``
(no clipping) and with ``overlap_forward``. On a CPU machine the "device" is the CPU itself (the
same code, plain copies); the GPU variant runs it on CUDA streams.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.comm.testing import run_distributed

pytest.importorskip("slipstream.offload")

MICRO = 2
KEEP, CLIP = 1e3, 1e-3  # a clip the norm never reaches, and one it always exceeds
CLIPS = [KEEP, KEEP, CLIP, CLIP, KEEP, KEEP]


def _run(shortcuts: bool, clip: bool, overlap_forward: bool) -> dict:
    import slipstream
    from slipstream import comm
    from slipstream.zero.offload import OffloadedStep
    from slipstream.zero.testing import TinyTransformer, batch_for

    streams = OffloadedStep.streams
    if not shortcuts:  # gpu_share as before: host gradients in, host masters uploaded
        OffloadedStep.streams = property(lambda self: False)  # type: ignore[method-assign]
    try:
        world, rank = comm.get_world_size(), comm.get_rank()
        torch.manual_seed(0)
        model = TinyTransformer(unused=True)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        other = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": other, "lr": 0.02}], lr=0.01
        )
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": CLIPS[0] if clip else 0.0,
            "steps_per_print": 1000,
            "bf16": {"enabled": True},
            "communication_data_type": "bf16",
            "zero_optimization": {
                "stage": 2,
                "reduce_bucket_size": 600,
                "allgather_bucket_size": 500,
                "offload_optimizer": {
                    "device": "cpu",
                    "pin_memory": torch.cuda.is_available(),
                    "gpu_share": 0.5,
                    "overlap_forward": overlap_forward,
                },
            },
        }
        engine, *_ = slipstream.initialize(model=model, optimizer=optimizer, config=config)
        step = engine.zero.optimizer.offload
        host = step.host
        taken = {"kept": 0, "lent": 0}
        take_kept, lend = host.take_kept, step.lend_grads

        def counting_take(param: torch.Tensor) -> object:
            kept = take_kept(param)
            taken["kept"] += kept is not None
            return kept

        def counting_lend(indices: list, offsets: list, reduced: object) -> None:
            taken["lent"] += reduced is not None
            lend(indices, offsets, reduced)

        host.take_kept = counting_take
        step.lend_grads = counting_lend
        if engine.zero.reducer.lend_grads is not None:
            engine.zero.reducer.lend_grads = counting_lend
        dev = next(engine.module.parameters()).device
        masters = engine.zero.masters
        snapshots, norms = [], []
        for index, limit in enumerate(CLIPS):
            if clip:
                engine.config.gradient_clipping = limit
            ids, labels = (t.to(dev) for t in batch_for(index, 0, MICRO * world))
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(engine(ids[mine], labels[mine]))
            engine.step()
            engine.wait_for_step()
            norms.append(float(engine.get_global_grad_norm()))
            zero = engine.zero
            for param, master, spec in zip(zero.params, masters.masters, zero.specs):
                lo, hi = spec.valid_range(rank)
                mine_ = param.detach().reshape(-1)[lo:hi]
                expected = master.detach().reshape(-1)[: hi - lo].to(mine_.device, mine_.dtype)
                assert torch.equal(mine_, expected), f"step {index}: published != master"
            state = engine.optimizer.state
            stepped = [m for m in masters.masters if state[m]]
            snapshots.append(
                [p.detach().cpu().clone() for p in engine.module.parameters()]
                + [m.detach().clone() for m in masters.masters]
                + [state[m][k].clone() for m in stepped for k in ("exp_avg", "exp_avg_sq")]
            )
        stats = step.speculation
        result = {
            "snapshots": snapshots,
            "norms": norms,
            "taken": taken,
            "left": len(host._kept),
            "kept": stats.kept,
            "discarded": stats.discarded,
        }
        engine.destroy()
        return result
    finally:
        OffloadedStep.streams = streams  # type: ignore[method-assign]


def _compare() -> list[dict]:
    out = []
    for clip, overlap_forward in ((True, False), (False, False), (True, True)):
        new = _run(True, clip, overlap_forward)
        old = _run(False, clip, overlap_forward)
        same = all(
            len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
            for a, b in zip(new.pop("snapshots"), old.pop("snapshots"))
        )
        out.append({"case": (clip, overlap_forward), "same": same, "new": new, "old": old})
    return out


def _check(results: list[list[dict]]) -> None:
    for rank_results in results:
        for result in rank_results:
            new, old = result["new"], result["old"]
            assert result["same"], result
            assert new["norms"] == old["norms"]
            # The shortcuts were taken (every bucket's streamed share), and not in the run
            # that turns them off; nothing kept is left behind.
            assert new["taken"]["kept"] > 0 and new["taken"]["lent"] > 0, result
            assert old["taken"] == {"kept": 0, "lent": 0}, result
            assert new["left"] == 0, result
            clip, _ = result["case"]
            if clip:
                assert new["kept"] > 0 and new["discarded"] > 0, result
                assert (new["kept"], new["discarded"]) == (old["kept"], old["discarded"])


def test_gpu_share_shortcuts_change_nothing() -> None:
    _check(run_distributed(_compare, 2, timeout=600))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
def test_gpu_share_shortcuts_change_nothing_on_gpus() -> None:
    # Streamed on CUDA streams; lent gradients are the reducer's device outputs, kept values
    # are published from the forward (overlap_forward) through the early-upload stream.
    world = min(2, torch.cuda.device_count())
    _check(run_distributed(_compare, world, backend="nccl", timeout=600))
