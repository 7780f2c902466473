"""gpu_share in training: the streamed share of each bucket reads its gradients where they were
reduced and keeps its new values on the device for the publish.

With ``offload_optimizer.gpu_share`` a share of each bucket's elements steps on the device
(StreamedAdam) during backward. That share reads the bucket's reduced gradients on the device
(lent by the reducer) instead of their host copy, and its new values, cast to the model's dtype
there, are what the publish sends for those elements instead of uploading the host master. The
run must be the run without either shortcut bit for bit (same losses, weights, masters, Adam
states and norms after every step): with the speculative step (kept, discarded and paused),
with ``overlap_step`` (no clipping), with gradient accumulation (no lent gradients at the
boundary, kept values still published) and with ``overlap_forward`` (early uploads packed on
the worker). On a CPU machine the "device" is the CPU itself (the same code, plain copies); the
GPU variant runs it on CUDA streams, and on a difference it also runs each shortcut alone to
say which one differs.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.comm.testing import run_distributed

pytest.importorskip("slipstream.offload")

MICRO = 2
KEEP, CLIP = 1e3, 1e-3  # a clip the norm never reaches, and one it always exceeds
# kept, kept, discarded, discarded (two in a row: the next step is not speculated), paused,
# kept
CLIPS = [KEEP, KEEP, CLIP, CLIP, KEEP, KEEP]
# (clip, overlap_forward, gradient accumulation steps)
CASES = [(True, False, 1), (False, False, 1), (True, True, 1), (True, False, 2)]


def _run(lend: bool, keep: bool, clip: bool, overlap_forward: bool, gas: int) -> dict:
    import slipstream
    from slipstream import comm
    from slipstream.zero.testing import TinyTransformer, batch_for, two_group_params

    world, rank = comm.get_world_size(), comm.get_rank()
    torch.manual_seed(0)
    model = TinyTransformer(unused=True)
    optimizer = torch.optim.AdamW(two_group_params(model), lr=0.01)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
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
    zero = engine.zero
    step = zero.optimizer.offload
    host = step.host
    reducer = zero.reducer
    if overlap_forward and not torch.cuda.is_available():
        step.stage_upload = zero._stage_upload  # early uploads packed on the worker, on CPU too
    # The shortcuts are on by default with gpu_share; the reference run turns them off: no
    # lent gradients (the streamed share reads the host copy) and nothing kept on the device
    # (the publish uploads every element's master).
    assert step.streams and reducer.lend_grads is not None and host.keep_dtype is not None
    if not lend:
        reducer.lend_grads = None
    if not keep:
        host.keep_dtype = None
    taken = {"kept": 0, "lent": 0}
    take_kept, lend_grads = host.take_kept, reducer.lend_grads

    def counting_take(param: torch.Tensor) -> object:
        kept = take_kept(param)
        taken["kept"] += kept is not None
        return kept

    def counting_lend(indices: list, offsets: list, reduced: object) -> None:
        taken["lent"] += reduced is not None
        assert lend_grads is not None
        lend_grads(indices, offsets, reduced)

    host.take_kept = counting_take
    if lend:
        reducer.lend_grads = counting_lend
    dev = next(engine.module.parameters()).device
    masters = zero.masters
    snapshots, norms, losses = [], [], []
    for index, limit in enumerate(CLIPS):
        if clip:
            engine.config.gradient_clipping = limit
        for micro in range(gas):
            ids, labels = (t.to(dev) for t in batch_for(index * gas + micro, 0, MICRO * world))
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            loss = engine(ids[mine], labels[mine])
            losses.append(float(loss))
            engine.backward(loss)
            engine.step()  # an accumulation step until the boundary
        engine.wait_for_step()
        norms.append(float(engine.get_global_grad_norm()))
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
        "losses": losses,
        "taken": taken,
        "left": len(host._kept),
        "lent_left": len(host.device_grads),
        "kept": stats.kept,
        "discarded": stats.discarded,
    }
    engine.destroy()
    return result


def _first_difference(new: dict, old: dict) -> str | None:
    """Where two runs first differ (step, tensor, how much), or None."""
    if new["losses"] != old["losses"]:
        return f"losses {new['losses']} != {old['losses']}"
    for index, (a, b) in enumerate(zip(new["snapshots"], old["snapshots"])):
        if len(a) != len(b):
            return f"step {index}: {len(a)} != {len(b)} tensors"
        for k, (x, y) in enumerate(zip(a, b)):
            if not torch.equal(x, y):
                worst = float((x.float() - y.float()).abs().max())
                return f"step {index}, tensor {k} of {len(a)} {tuple(x.shape)}: max |diff| {worst}"
    if new["norms"] != old["norms"]:
        return f"norms {new['norms']} != {old['norms']}"
    return None


def _compare(cases: list[tuple[bool, bool, int]], diagnose: bool) -> list[dict]:
    out = []
    for clip, overlap_forward, gas in cases:
        case = (clip, overlap_forward, gas)
        new = _run(True, True, *case)
        old = _run(False, False, *case)
        difference = _first_difference(new, old)
        alone = {}
        if difference is not None and diagnose:
            # Which shortcut differs: each alone against the reference.
            for name, lend, keep in (("lend only", True, False), ("keep only", False, True)):
                alone[name] = _first_difference(_run(lend, keep, *case), old)
        for run in (new, old):
            del run["snapshots"]
        out.append({"case": case, "difference": difference, "alone": alone, "new": new, "old": old})
    return out


def _check(results: list[list[dict]]) -> None:
    for rank, rank_results in enumerate(results):
        for result in rank_results:
            new, old = result["new"], result["old"]
            assert result["difference"] is None, (rank, result)
            # The shortcuts were taken (every bucket's streamed share), and not in the run
            # that turns them off; nothing kept or lent is left behind.
            clip, _, gas = result["case"]
            assert new["taken"]["kept"] > 0, result
            assert (new["taken"]["lent"] > 0) == (gas == 1), result  # a boundary's own only
            assert old["taken"] == {"kept": 0, "lent": 0}, result
            assert new["left"] == 0 and new["lent_left"] == 0, result
            if clip:
                assert new["kept"] > 0 and new["discarded"] > 0, result
                assert (new["kept"], new["discarded"]) == (old["kept"], old["discarded"])


def test_gpu_share_shortcuts_change_nothing() -> None:
    _check(run_distributed(_compare, 2, CASES, False, timeout=600))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"clip{int(c[0])}-ovf{int(c[1])}-gas{c[2]}")
def test_gpu_share_shortcuts_change_nothing_on_gpus(case) -> None:
    # Streamed on CUDA streams; lent gradients are the reducer's device outputs, kept values
    # are published from finish() or, with overlap_forward, through the early-upload stream.
    world = min(2, torch.cuda.device_count())
    _check(run_distributed(_compare, world, [case], True, backend="nccl", timeout=600))
