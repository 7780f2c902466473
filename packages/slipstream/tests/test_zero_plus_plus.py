"""ZeRO++ (qwZ, qgZ) and MiCS through slipstream.initialize vs plain ZeRO-3, step by step,
with the collectives' bytes read from the comms logger."""

from __future__ import annotations

import copy

import torch

from slipstream.comm.testing import run_distributed

STEPS, MICRO, VOCAB, DIM = 3, 2, 64, 32


def _run(
    model: torch.nn.Module,
    extra: dict,
    directory: str = "",
    top: dict | None = None,
    under_init: bool = False,
) -> tuple[list[float], list[torch.Tensor], dict]:
    """Train a copy of ``model`` at ZeRO-3 with ``extra`` ZeRO keys; losses, weights, bytes.
    ``under_init``: the copy is made inside ``zero.Init`` (partitioned before initialize)."""
    import slipstream
    from slipstream import comm
    from slipstream.zero import GatheredParameters
    from slipstream.zero.testing import batch_for

    world, rank = comm.get_world_size(), comm.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "steps_per_print": 1000,
        "zero_optimization": {
            "stage": 3,
            # Every parameter is gathered for each use (none kept whole), one bucket each.
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 4096,
            **extra,
        },
        **(top or {}),
    }
    module = copy.deepcopy(model)
    if under_init:
        from slipstream.zero import Init

        Init(module=module, config_dict_or_path=config)  # partitions it now, over the world
    engine, _, _, _ = slipstream.initialize(model=module, config=config)
    comm.comms_logger.configure(enabled=True, prof_all=True)
    comm.comms_logger.reset()
    losses = []
    for step in range(STEPS):
        ids, labels = batch_for(step, 0, MICRO * world, vocab=VOCAB)
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = engine(ids[mine], labels[mine])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        comm.all_reduce(total)
        losses.append(float(total) / world)
    records = comm.comms_logger.records
    comm.comms_logger.configure(enabled=False)
    sent = {name: sum(s.total_bytes for s in sizes.values()) for name, sizes in records.items()}
    # Bus bytes: what crosses the busiest link (a gather over n ranks moves (n-1)/n of it).
    sent.update(
        {name + "_bus": sum(s.bus_bytes for s in sizes.values()) for name, sizes in records.items()}
    )
    with GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().clone() for p in engine.module.parameters()]
    return losses, weights, sent


def _mics_checkpoint(model: torch.nn.Module, directory: str) -> dict:
    """MiCS (2-rank shard groups, 2 replicas) saves after 2 steps and trains 2 more; plain
    ZeRO-3 over 4 ranks and MiCS again resume from the checkpoint: the same 2 losses."""
    import slipstream
    from slipstream import comm
    from slipstream.zero.testing import batch_for

    world, rank = comm.get_world_size(), comm.get_rank()

    def engine_with(extra: dict) -> object:
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "steps_per_print": 1000,
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 4096, **extra},
        }
        return slipstream.initialize(model=copy.deepcopy(model), config=config)[0]

    def train(engine: object, steps: range) -> list[float]:
        losses = []
        for step in steps:
            ids, labels = batch_for(step, 0, MICRO * world, vocab=VOCAB)
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            loss = engine(ids[mine], labels[mine])  # type: ignore[operator]
            engine.backward(loss)  # type: ignore[attr-defined]
            engine.step()  # type: ignore[attr-defined]
            total = loss.detach().clone()
            comm.all_reduce(total)
            losses.append(float(total) / world)
        return losses

    mics = engine_with({"mics_shard_size": 2})
    train(mics, range(2))
    mics.save_checkpoint(directory)  # type: ignore[attr-defined]
    expected = train(mics, range(2, 4))
    out: dict = {"expected": expected}
    for name, extra in (("plain", {}), ("mics", {"mics_shard_size": 2})):
        resumed = engine_with(extra)
        resumed.load_checkpoint(directory)  # type: ignore[attr-defined]
        assert resumed.global_steps == 2  # type: ignore[attr-defined]
        out[name] = train(resumed, range(2, 4))
    import json
    from pathlib import Path

    tag = (Path(directory) / "latest").read_text().strip()
    manifest = json.loads((Path(directory) / tag / "manifest.json").read_text())
    out["dp_world_size"] = manifest["dp_world_size"]
    out["model_files"] = sorted(e["name"] for e in manifest["files"] if e["kind"] == "model")
    return out


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all weights together."""
    diff = torch.cat([(x - y).reshape(-1) for x, y in zip(a, b)])
    return float(diff.norm() / torch.cat([y.reshape(-1) for y in b]).norm())


def _hierarchical_gather() -> dict:
    """MiCS's two-hop gather on 4 ranks as 2 "nodes" of 2 (one shard group of 4): the same
    values as the flat gather, and only the first hop (half its bytes) crosses the nodes."""
    from slipstream import comm
    from slipstream.zero import DataParallelGroup
    from slipstream.zero.zeropp import build_zero_group

    group = build_zero_group(mics_shard_size=4, hierarchical_gather=True, node_size=2)
    rank = comm.get_rank()
    shard = torch.arange(5, dtype=torch.float32) + 10 * rank
    flat, two_hop = torch.empty(20), torch.empty(20)
    DataParallelGroup.of().all_gather_into(flat, shard)
    comm.comms_logger.configure(enabled=True, prof_all=True)
    comm.comms_logger.reset()
    group.all_gather_into(two_hop, shard, async_op=True).wait()
    records = comm.comms_logger.records
    comm.comms_logger.configure(enabled=False)
    received = {name: sum(s.bus_bytes for s in sizes.values()) for name, sizes in records.items()}
    return {"equal": torch.equal(flat, two_hop), "received": received}


def _zero_plus_plus_world(directory: str) -> dict:
    from slipstream.zero.testing import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, dim=DIM)
    plain = _run(model, {})
    qwz = _run(model, {"zero_quantized_weights": True})
    qgz = _run(model, {"zero_quantized_gradients": True})
    both = _run(model, {"zero_quantized_weights": True, "zero_quantized_gradients": True})
    qgz4 = _run(model, {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 4})
    hpz_qgz4 = _run(
        model,
        {
            "zero_hpz_partition_size": 2,
            "zero_quantized_gradients": True,
            "zero_quantized_gradients_bits": 4,
        },
    )
    mics = _run(model, {"mics_shard_size": 2})
    # On CPU a "node" is one device: every hop of the two-hop gather, bit-equal to MiCS.
    mics_hier = _run(model, {"mics_shard_size": 2, "mics_hierarchical_params_gather": True})
    hpz = _run(model, {"zero_hpz_partition_size": 2})
    # Parameters partitioned by zero.Init adopt the engine's ZeRO++ group (its int8 gathers).
    qwz_init = _run(model, {"zero_quantized_weights": True}, under_init=True)
    hpz_qgz = _run(model, {"zero_hpz_partition_size": 2, "zero_quantized_gradients": True})
    # bf16 parameters and gradient reduction: the bytes that int8 halves.
    bf16 = {"bf16": {"enabled": True}, "communication_data_type": "bf16"}
    plain_bf16 = _run(model, {}, top=bf16)
    quantized_bf16 = _run(
        model, {"zero_quantized_weights": True, "zero_quantized_gradients": True}, top=bf16
    )
    out = {"plain": plain[2], "qwz": qwz[2], "qgz": qgz[2], "mics": mics[2], "hpz": hpz[2]}
    out["plain_bf16"], out["quantized_bf16"] = plain_bf16[2], quantized_bf16[2]
    out["mics_checkpoint"] = _mics_checkpoint(model, directory)
    out["mics_hier_same"] = mics_hier[0] == mics[0] and all(
        torch.equal(a, b) for a, b in zip(mics_hier[1], mics[1])
    )
    out["hierarchical"] = _hierarchical_gather()
    out["hpz_qgz"] = hpz_qgz[2]
    out["qgz4"], out["hpz_qgz4"] = qgz4[2], hpz_qgz4[2]
    out["qwz_init"] = qwz_init[2]
    out["qwz_init_same"] = qwz_init[0] == qwz[0]
    out["hpz_qgz_loss"] = max(abs(a - b) / b for a, b in zip(hpz_qgz[0], plain[0]))
    out["hpz_qgz_weights"] = _rel(hpz_qgz[1], plain[1])
    out["bf16_loss"] = max(abs(a - b) / b for a, b in zip(quantized_bf16[0], plain_bf16[0]))
    runs = (("qwz", qwz), ("qgz", qgz), ("both", both), ("mics", mics), ("hpz", hpz))
    for name, run in (*runs, ("qgz4", qgz4), ("hpz_qgz4", hpz_qgz4)):
        out[name + "_loss"] = max(abs(a - b) / b for a, b in zip(run[0], plain[0]))
        out[name + "_weights"] = _rel(run[1], plain[1])
    return out


def test_qwz_qgz_mics_match_plain_zero3_with_fewer_bytes(tmp_path) -> None:
    result = run_distributed(_zero_plus_plus_world, 4, str(tmp_path), timeout=300)[0]
    plain, qwz, qgz, mics = result["plain"], result["qwz"], result["qgz"], result["mics"]
    # MiCS reorders the same fp32 sums (within 2 ranks, then across 2 replicas): equal to
    # plain ZeRO-3 up to rounding.
    assert result["mics_loss"] <= 1e-6 and result["mics_weights"] <= 1e-6, result
    # MiCS gathers the same tensors within its 2-rank group: each rank receives 1/2 of a
    # parameter instead of 3/4, plus gradient all-reduces across the replicas.
    assert mics["all_gather_into_tensor"] == plain["all_gather_into_tensor"], result
    ratio = mics["all_gather_into_tensor_bus"] / plain["all_gather_into_tensor_bus"]
    assert abs(ratio - (1 / 2) / (3 / 4)) < 1e-9, result
    assert mics["all_reduce"] > plain.get("all_reduce", 0), result
    # mics_hierarchical_params_gather: the same training, bit for bit; with 2 "nodes" of 2,
    # the same gathered values, and the cross-node hop receives 1 shard per rank where a flat
    # gather over the 4 ranks receives 2 from the other node (1/2 of the cross-node bytes).
    assert result["mics_hier_same"], result
    hier = result["hierarchical"]
    assert hier["equal"], hier
    across, inside = (
        hier["received"]["mics_gather_across_nodes"],
        hier["received"]["mics_gather_in_node"],
    )
    assert across == 1 * 5 * 4 and inside == 2 * 5 * 4, hier  # bus bytes: shards of 5 fp32
    # MiCS checkpoints: the first replica's shards, a ZeRO layout over the 2-rank shard
    # group; plain ZeRO-3 over 4 ranks and MiCS resume with the uninterrupted losses.
    saved = result["mics_checkpoint"]
    assert saved["dp_world_size"] == 2, saved
    assert saved["model_files"] == ["model.rank0.safetensors", "model.rank1.safetensors"], saved
    for name in ("plain", "mics"):
        for got, want in zip(saved[name], saved["expected"], strict=True):
            assert abs(got - want) <= 1e-6 * abs(want), (name, saved)
    # hpZ gathers the same values (primary shards across 4 ranks on first use, secondary ones
    # within each 2-rank "node" after): bit-equal training, fewer bytes over the busiest link.
    hpz = result["hpz"]
    assert result["hpz_loss"] == 0 and result["hpz_weights"] == 0, result
    assert hpz["all_gather_into_tensor"] == plain["all_gather_into_tensor"], result
    # Each parameter is gathered once in forward (3/4 of it per rank) and once in backward
    # (1/2 instead of 3/4 within the node): (3/4 + 1/2) / (3/4 + 3/4) = 0.83 of the bus bytes.
    ratio = hpz["all_gather_into_tensor_bus"] / plain["all_gather_into_tensor_bus"]
    assert 0.78 < ratio < 0.84, result
    # hpZ + qgZ: the gradient all-to-all in two int8 hops (inside the 2-rank node, then across
    # nodes on half the rows): all-to-all bytes 1 + 1/2 times the flat qgZ's, of which only
    # the second hop's third crosses nodes; two roundings, the same error budget.
    assert 0 < result["hpz_qgz_loss"] <= 1e-2 and 0 < result["hpz_qgz_weights"] <= 1e-2, result
    ratio = result["hpz_qgz"]["all_to_all_single"] / qgz["all_to_all_single"]
    assert 1.4 < ratio < 1.6, result
    # qwZ/qgZ: int8 with one fp32 scale per 256 values (or per shard when smaller) bounds each
    # value's error by half a step, |block max| / 254 (0.4% of the block's largest value), so
    # the weights (gradients) each step sees are within 0.4% of the plain run's; over 3 SGD
    # steps the losses stay within 1% and the weights within 1% (in norm) of plain ZeRO-3.
    # Nonzero: the int8 path really ran.
    for name in ("qwz", "qgz", "both"):
        assert 0 < result[name + "_loss"] <= 1e-2, (name, result)
        assert 0 < result[name + "_weights"] <= 1e-2, (name, result)
    # Bytes, fp32 (4 B/value) vs int8 codes + one fp32 scale per block: 4 / (1 + 4/256) =
    # 3.94x for shards of 256+ values; this tiny model's many sub-256 shards (one scale each)
    # give 3.25x for the gathers and 3.46x for the gradients' all-to-all. (vs bf16: half that.)
    assert plain["all_gather_into_tensor"] / qwz["all_gather_into_tensor"] > 3.2, result
    # The same under zero.Init: the same bytes and losses as the qwZ run built outside it.
    assert result["qwz_init"]["all_gather_into_tensor"] == qwz["all_gather_into_tensor"], result
    assert result["qwz_init_same"], result
    assert "reduce_scatter_tensor" not in qgz, result
    # int4 qgZ (zero_quantized_gradients_bits 4): two codes per byte, the same scales: about
    # half of int8's all-to-all bytes (flat and hpZ's two hops); a half step is |block max|/14
    # (7 % of the block's largest value, vs 0.4 % for int8): over 3 SGD steps the losses stay
    # within 2 % and the weights within 5 % (in norm) of plain ZeRO-3, and differ from it.
    for four, eight in (("qgz4", "qgz"), ("hpz_qgz4", "hpz_qgz")):
        ratio = result[four]["all_to_all_single"] / result[eight]["all_to_all_single"]
        assert 0.45 < ratio < 0.55, (four, result)
        assert 0 < result[four + "_loss"] <= 2e-2, (four, result)
        assert 0 < result[four + "_weights"] <= 5e-2, (four, result)
    assert plain["reduce_scatter_tensor"] / qgz["all_to_all_single"] > 3.4, result
    # Against bf16 (2 B/value): 2 / (1 + 4/256) = 1.97x for large shards; 1.6x+ here.
    plain_bf16, quantized_bf16 = result["plain_bf16"], result["quantized_bf16"]
    ratio = plain_bf16["all_gather_into_tensor"] / quantized_bf16["all_gather_into_tensor"]
    assert ratio > 1.6, result
    assert plain_bf16["reduce_scatter_tensor"] / quantized_bf16["all_to_all_single"] > 1.7, result
    assert result["bf16_loss"] <= 2e-2, result
