"""Stages 1-2: the split last bucket, the copy-engine publish, capped CTAs and averaging in the
reduce-scatter train bit for bit like the plain path (on CPU the last three fall back, which is
checked); send buffers zero what no gradient covers."""

from __future__ import annotations

import os

import pytest
import torch

from slipstream.comm.testing import run_distributed
from slipstream.zero import ShardedOptimizerStates, ZeroSettings
from slipstream.zero.grad_reduce import plan_buckets
from slipstream.zero.layout import ShardSpec
from slipstream.zero.peer_publish import symmetric_buffer_layout
from slipstream.zero.testing import TinyTransformer, batch_for

STEPS, GAS, MICRO = 3, 2, 2

# Every variant but "default" starts from these (the keys' old defaults, all off).
OFF = {
    "reduce_bucket_tail_numel": 0,
    "publish_transport": "collective",
    "average_in_reduce_scatter": False,
}

# name -> (ZeroSettings overrides, publish_during_forward); "default": ZeroSettings' defaults
# (the tail split, publish_transport "auto", average_in_reduce_scatter on).
VARIANTS: dict[str, tuple[dict, bool]] = {
    "plain": ({}, False),
    # The automatic tail (5e7) splits nothing in this model: a small one stands in for it.
    "default": ({"reduce_bucket_tail_numel": 300}, False),
    "tail": ({"reduce_bucket_tail_numel": 300}, False),
    "copy_engine": ({"publish_transport": "copy_engine"}, False),
    "copy_engine+pf": ({"publish_transport": "copy_engine", "allgather_bucket_numel": 500}, True),
    "ctas": ({"reduce_scatter_max_ctas": 4}, False),
    "avg": ({"average_in_reduce_scatter": True}, False),
    "all": (
        {
            "reduce_bucket_tail_numel": 300,
            "publish_transport": "copy_engine",
            "reduce_scatter_max_ctas": 4,
            "average_in_reduce_scatter": True,
        },
        True,
    ),
}


def test_the_last_bucket_is_split_into_tail_buckets() -> None:
    specs = [ShardSpec(torch.Size([n]), 1) for n in (10, 10, 10, 30, 40)]
    assert plan_buckets(specs, 80) == [[4, 3, 2], [1, 0]]
    assert plan_buckets(specs, 80, tail_numel=10) == [[4, 3, 2], [1], [0]]
    # Only the last bucket is split; one parameter over the tail still travels alone.
    assert plan_buckets(specs, 100, tail_numel=25) == [[4], [3], [2, 1], [0]]
    assert plan_buckets(specs, 100, tail_numel=0) == [[4, 3, 2, 1, 0]]
    # The defaults: a 5e7 tail with the masters on the device, none with optimizer offload;
    # the copy engines where they work; the average inside the reduce-scatter.
    defaults = ZeroSettings(stage=2)
    assert defaults.tail_numel(offloaded=False) == 50_000_000
    assert defaults.tail_numel(offloaded=True) == 0
    assert ZeroSettings(stage=2, reduce_bucket_tail_numel=0).tail_numel(offloaded=False) == 0
    assert defaults.publish_transport == "auto" and defaults.average_in_reduce_scatter
    with pytest.raises(ValueError, match="reduce_bucket_tail_numel"):
        ZeroSettings(stage=2, reduce_bucket_tail_numel=-1)
    with pytest.raises(ValueError, match="publish_transport"):
        ZeroSettings(stage=2, publish_transport="nvlink")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduce_scatter_max_ctas"):
        ZeroSettings(stage=2, reduce_scatter_max_ctas=-2)


def test_the_symmetric_buffer_is_counted_by_the_memory_report() -> None:
    # Each parameter starts on a 128-byte boundary: 64 bf16 elements, 32 fp32 ones.
    assert symmetric_buffer_layout([10, 64, 65, 1], 2) == ([0, 64, 128, 256], 320)
    assert symmetric_buffer_layout([10, 64, 65, 1], 4) == ([0, 32, 96, 192], 224)
    assert symmetric_buffer_layout([], 2) == ([], 1)
    # 1.3B-class parameters in bf16: about their own size (the alignment adds little).
    numels = [32000 * 2048] + [2048 * 2048, 2048 * 5504] * 96
    _, total = symmetric_buffer_layout(numels, 2)
    assert 0 <= total - sum(numels) < 64 * len(numels)
    # On the CPU the copy-engine publish falls back, and nothing is outside the allocator.
    result = train_variants((2,))
    for (_, name), got in result.items():
        assert not any(k.startswith("publish_buffer_") for k in got["report"]), name


def test_multicast_is_turned_off_once_unless_the_user_chose(monkeypatch, caplog) -> None:
    from slipstream.zero import peer_publish

    for preset, expected in ((None, "1"), ("0", "0")):
        monkeypatch.setattr(peer_publish, "_multicast_decided", False)
        if preset is None:
            monkeypatch.delenv(peer_publish.MULTICAST_ENV, raising=False)
        else:
            monkeypatch.setenv(peer_publish.MULTICAST_ENV, preset)
        caplog.clear()
        with caplog.at_level("INFO", logger=peer_publish.__name__):
            peer_publish._no_multicast()
            peer_publish._no_multicast()  # once per process: no second message
        assert os.environ[peer_publish.MULTICAST_ENV] == expected
        assert len(caplog.records) == 1 and peer_publish.MULTICAST_ENV in caplog.text


def train_variants(stages: tuple[int, ...], device: str = "cpu", dtype: str = "fp32") -> dict:
    """Every variant at each stage on the same data: the final parameters, the losses and
    why the copy-engine path and the CTA cap fell back (per variant)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    out: dict = {}
    for stage in stages:
        for name, (overrides, lazy) in VARIANTS.items():
            torch.manual_seed(0)
            model = TinyTransformer().to(device)
            if dtype == "bf16":
                model.to(torch.bfloat16)
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
            keys = overrides if name == "default" else {**OFF, **overrides}
            settings = ZeroSettings(stage=stage, reduce_bucket_numel=700, **keys)
            zero = ShardedOptimizerStates(list(model.parameters()), optimizer, settings)
            if lazy:
                assert zero.publish_during_forward(model)
            losses = []
            landed: list[bool] = []
            for step in range(STEPS):
                if step == 1:
                    # A parameter's .data replaced between steps (same shape and dtype): the
                    # copy-engine publish points it back into its buffer (PeerPublish._rehome).
                    zero.complete_step()
                    first = next(model.parameters())
                    first.data = first.data.clone()
                for m in range(GAS):
                    ids, labels = batch_for(step, m, MICRO * world)
                    mine = slice(rank * MICRO, (rank + 1) * MICRO)
                    boundary = m == GAS - 1
                    zero.prepare_backward(boundary)
                    loss = model(ids[mine].to(device), labels[mine].to(device))
                    (loss / GAS).backward()
                    zero.finish_backward(boundary)
                    losses.append(float(loss.detach()))
                landed.append(_landed_squares_exact(zero))
                zero.optimizer.step(max_grad_norm=0.5)
                zero.zero_grad()
            zero.complete_step()
            out[(stage, name)] = {
                "params": [p.detach().float().cpu().clone() for p in model.parameters()],
                "losses": losses,
                "transport": zero.publish_transport,
                "publish_fallback": zero.publish_fallback,
                "ctas_fallback": zero.reduce_ctas_fallback,
                "avg_fallback": zero.reducer.average_fallback,
                "buckets": zero.reducer.num_buckets,
                "landed_exact": landed,
                "report": zero.memory_report(),
                "numels": [p.numel() for p in model.parameters() if p.requires_grad],
            }
            zero.remove_hooks()
    return out


def _landed_squares_exact(zero: ShardedOptimizerStates) -> bool:
    """Whether the reducer took the step's sum of squares as the buckets landed, equal bit
    for bit to the one the step would take itself, and the step will use it."""
    from slipstream.zero.norms import local_squares

    landed = zero.masters.landed_squares
    grads = zero.masters.grads()
    if landed is None or not landed.covers(grads):
        return False
    return torch.equal(landed.total, local_squares(grads, grads[0].device))


def test_the_step_retakes_the_squares_of_gradients_changed_after_backward() -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    zero = ShardedOptimizerStates(
        list(model.parameters()), optimizer, ZeroSettings(stage=2, reduce_bucket_numel=700)
    )
    ids, labels = batch_for(0, 0, MICRO)
    model(ids, labels).backward()
    zero.finish_backward(True)
    assert _landed_squares_exact(zero)
    grads = zero.masters.grads()
    grads[0].mul_(3.0)  # e.g. a caller's own scaling between backward and step
    landed = zero.masters.landed_squares
    assert landed is not None and not landed.covers(grads)
    from slipstream.zero.norms import global_grad_norm

    expected = global_grad_norm(grads, zero.group, grads[0].device)
    outcome = zero.optimizer.step(max_grad_norm=0.0)
    assert outcome.grad_norm is not None and torch.equal(outcome.grad_norm, expected)
    assert zero.masters.landed_squares is None
    # A backward that does not end the accumulation takes no squares.
    zero.zero_grad()
    zero.prepare_backward(False)
    model(ids, labels).backward()
    zero.finish_backward(False)
    assert zero.masters.landed_squares is None
    zero.remove_hooks()


def test_no_squares_at_landing_when_the_caller_sums_them() -> None:
    """A caller that passes ``grad_squares`` to every step (a pipeline) has the reducer take
    no squares of its own, and the step still uses the caller's."""
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    zero = ShardedOptimizerStates(
        list(model.parameters()),
        optimizer,
        ZeroSettings(stage=2, reduce_bucket_numel=700),
        caller_sums_squares=True,
    )
    ids, labels = batch_for(0, 0, MICRO)
    model(ids, labels).backward()
    zero.finish_backward(True)
    assert zero.masters.landed_squares is None
    from slipstream.zero.norms import local_squares

    grads = zero.masters.grads()
    squares = local_squares(grads, grads[0].device)
    outcome = zero.optimizer.step(max_grad_norm=0.0, grad_squares=squares)
    assert outcome.grad_norm is not None and torch.equal(outcome.grad_norm, squares.sqrt())
    zero.remove_hooks()


def _check_equal(result: dict, stages: tuple[int, ...], exact_tail: bool = True) -> None:
    """Every variant equals the plain path bit for bit. ``exact_tail=False`` (3+ ranks):
    the split tail regroups gradients into other collectives, and a ring reduction over 3+
    ranks may then add the same terms in another order (as any other reduce_bucket_size
    does); those variants are held to fp32 rounding instead."""
    for stage in stages:
        plain = result[(stage, "plain")]
        for name, (overrides, _) in VARIANTS.items():
            got = result[(stage, name)]
            assert got["landed_exact"] == [True] * STEPS, (stage, name)
            tail = "reduce_bucket_tail_numel" in overrides or name == "default"
            if exact_tail or not tail:
                assert got["losses"] == plain["losses"], (stage, name)
                for p, q in zip(got["params"], plain["params"], strict=True):
                    assert torch.equal(p, q), (stage, name)
                continue
            for p, q in zip(got["params"], plain["params"], strict=True):
                assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (stage, name)
        assert result[(stage, "tail")]["buckets"] > plain["buckets"]


def test_variants_match_the_plain_path_bit_for_bit_on_one_process() -> None:
    result = train_variants((1, 2))
    _check_equal(result, (1, 2))
    for (_stage, name), got in result.items():
        assert got["transport"] == "collective"
        if "copy_engine" in name or name in ("all", "default"):
            assert got["publish_fallback"] == "a group of one rank has nothing to publish"
        if name in ("ctas", "all"):
            assert got["ctas_fallback"] == "a group of one rank has no collectives"
        if name in ("avg", "all", "default"):
            assert got["avg_fallback"] == "a group of one rank does not reduce"


def _variants_and_padding(stages: tuple[int, ...]) -> dict:
    """One spawned world for both checks (CI time)."""
    result = train_variants(stages)
    result["padding"] = _padded_and_unused_vs_reference()
    return result


@pytest.mark.parametrize(("world_size", "stages"), [(2, (1, 2)), (3, (2,))])
def test_variants_match_the_plain_path_bit_for_bit_on_gloo(
    world_size: int, stages: tuple[int, ...]
) -> None:
    fn = _variants_and_padding if world_size == 3 else train_variants
    results = run_distributed(fn, world_size, stages, timeout=240)
    for result in results:
        padding = result.pop("padding", None)
        if world_size == 3:
            # Padding (every weight padded to a multiple of 3) and an unused layer, with NaN
            # in every new send buffer, against plain PyTorch.
            assert max(padding) <= 1e-6, padding
        _check_equal(result, stages, exact_tail=world_size == 2)
        for (_stage, name), got in result.items():
            assert got["transport"] == "collective"  # gloo, CPU: the all-gathers
            if "copy_engine" in name or name in ("all", "default"):
                assert got["publish_fallback"] == "the parameters are not all on one CUDA device"
            if name in ("ctas", "all"):
                assert got["ctas_fallback"] == "the process group's backend is 'gloo', not 'nccl'"
            if name in ("avg", "all", "default"):
                assert got["avg_fallback"] == (
                    "the process group's backend is 'gloo', not 'nccl'"
                    if world_size == 2
                    else "the group has 3 ranks, not a power of two (1/3 is inexact)"
                )
    for other in results[1:]:
        for key, got in other.items():
            for p, q in zip(got["params"], results[0][key]["params"], strict=True):
                assert torch.equal(p, q), key


def _on_gpus(dtype: str) -> dict:
    torch.cuda.set_device(torch.distributed.get_rank())
    return train_variants((1, 2), device="cuda", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_copy_engine_publish_equals_nccl_on_two_gpus(dtype: str) -> None:
    for result in run_distributed(_on_gpus, 2, dtype, backend="nccl", timeout=100):
        _check_equal(result, (1, 2))
        for (_stage, name), got in result.items():
            peer = "copy_engine" in name or name in ("all", "default")
            assert got["transport"] == ("copy_engine" if peer else "collective"), name
            assert got["publish_fallback"] == "", got["publish_fallback"]
            assert got["ctas_fallback"] == "", got["ctas_fallback"]
            assert got["avg_fallback"] == "", got["avg_fallback"]
            # The parameters' symmetric buffer, which max_memory_allocated leaves out.
            size = 2 if dtype == "bf16" else 4
            expected = symmetric_buffer_layout(got["numels"], size)[1] * size if peer else None
            assert got["report"].get("publish_buffer_cuda") == expected, name


def _padded_and_unused_vs_reference() -> list[float]:
    """Stages 1-2 on 3 ranks (every TinyTransformer weight padded to a multiple of 3) with a
    layer that gets no gradient, against plain PyTorch on the global batch; every new send
    buffer is poisoned with NaN, so what no gradient covers must be zeroed at launch."""
    import copy
    from unittest import mock

    import torch.distributed as dist

    from slipstream.zero.grad_reduce import GradientReduceScatter

    original = GradientReduceScatter._ensure_buffer

    def poisoned(self: GradientReduceScatter, bucket: object) -> torch.Tensor:
        fresh = bucket.buffer is None  # type: ignore[attr-defined]
        buffer = original(self, bucket)  # type: ignore[arg-type]
        if fresh:
            buffer.fill_(float("nan"))
        return buffer

    world, rank = dist.get_world_size(), dist.get_rank()
    worst = []
    with mock.patch.object(GradientReduceScatter, "_ensure_buffer", poisoned):
        for stage in (1, 2):
            torch.manual_seed(0)
            model = TinyTransformer(unused=True)
            reference = copy.deepcopy(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
            trainable = [p for p in reference.parameters() if p.requires_grad]
            ref_opt = torch.optim.AdamW(trainable, lr=0.01)
            settings = ZeroSettings(stage=stage, reduce_bucket_numel=700)
            zero = ShardedOptimizerStates(list(model.parameters()), optimizer, settings)
            for step in range(2):
                ids, labels = batch_for(step, 0, MICRO * world)
                mine = slice(rank * MICRO, (rank + 1) * MICRO)
                zero.prepare_backward(True)
                model(ids[mine], labels[mine]).backward()
                zero.finish_backward(True)
                zero.optimizer.step(max_grad_norm=0.5)
                zero.zero_grad()
                (reference(ids, labels)).backward()
                for p in trainable:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)  # ZeRO reduces zeros for it too
                torch.nn.utils.clip_grad_norm_(trainable, 0.5)
                ref_opt.step()
                ref_opt.zero_grad()
            pairs = zip(model.parameters(), reference.parameters(), strict=True)
            diffs = torch.stack([(p.detach() - q.detach()).abs().max() for p, q in pairs])
            worst.append(float(diffs.max()))  # a NaN anywhere stays NaN (Python's max drops it)
    return worst
