"""Training throughput of one implementation on the benchmark model, as BENCHMARKS.md measures it.

Launch one process per GPU (``torchrun --nproc_per_node 2 tools/bench/train_bench.py --impl fsdp2``);
rank 0 prints one ``BENCH {json}`` line with tokens/s, TFLOP/s per GPU and peak memory, and
appends it to ``--out`` when given. Implementations:

- ``ddp``: PyTorch DDP, fp32 weights, bf16 autocast, fused AdamW.
- ``fsdp2``: ``fully_shard`` per block and on the root, bf16 params, fp32 gradient reduction.
- ``slipstream``: ``slipstream.initialize`` with a DeepSpeed-style bf16 config at ``--stage``
  (``overlap_comm``, ``contiguous_gradients``, 5e8 buckets, AdamW), the loop users write.
- ``deepspeed``: ``deepspeed.initialize`` with the same config (DeepSpeed installed separately;
  it is not a dependency): the side-by-side reference of BENCHMARKS.md's DeepSpeed rows.

Every run: AdamW (lr 1e-4), gradient clipping at 1.0, a fixed random batch, ``--warmup`` untimed
steps then ``--steps`` timed ones between device synchronisations. For slipstream, two more
steps afterwards, with a synchronisation after each phase, give the time of forward, backward
and ``engine.step()`` alone (``phases_ms``: no overlap between the phases there) and the last
step's gradient norm (whether clipping at 1.0 fired). With CPU offload under clipping,
``speculation`` counts the speculative steps of the whole run and ``speculation_timed`` those
of the timed window; ``step_ms`` is each timed step's host time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama import SHAPES, Llama


def _setup() -> tuple[torch.device, int, int]:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend)
    return device, dist.get_rank(), dist.get_world_size()


def _slipstream_config(args: argparse.Namespace) -> dict[str, Any]:
    extra = {"communication_data_type": args.comm_dtype} if args.comm_dtype else {}
    return {
        **extra,
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": args.stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": args.reduce_bucket_size,
            "allgather_bucket_size": args.allgather_bucket_size,
            **({"publish_during_forward": True} if args.publish_during_forward else {}),
            **({"publish_transport": "copy_engine"} if args.copy_engine else {}),
            **({"reduce_scatter_max_ctas": args.max_ctas} if args.max_ctas else {}),
            **({"average_in_reduce_scatter": True} if args.avg_in_rs else {}),
            **(
                {"reduce_bucket_tail_size": args.reduce_bucket_tail}
                if args.reduce_bucket_tail
                else {}
            ),
            **(
                {"stage3_reduce_bucket_parts": args.stage3_bucket_parts}
                if args.stage3_bucket_parts is not None
                else {}
            ),
            **({"leaf_module": {"classes": ["Block"]}} if args.leaf_blocks else {}),
            **_offload_blocks(args),
            **_zero_plus_plus(args),
        },
        **({"sequence_parallel_size": args.sp} if args.sp > 1 else {}),
        **({"comms_logger": {"enabled": True, "prof_all": True}} if args.comms_log else {}),
    }


def _zero_plus_plus(args: argparse.Namespace) -> dict[str, Any]:
    """``--qwz``, ``--qgz`` and ``--mics N`` as their zero_optimization keys (stage 3)."""
    keys: dict[str, Any] = {}
    if args.qwz:
        keys["zero_quantized_weights"] = True
    if args.qgz:
        keys["zero_quantized_gradients"] = True
        if args.qgz_bits != 8:
            keys["zero_quantized_gradients_bits"] = args.qgz_bits
    if args.mics > 0:
        keys["mics_shard_size"] = args.mics
    if args.hpz > 1:
        keys["zero_hpz_partition_size"] = args.hpz
    return keys


def _comms_summary(steps: int) -> dict[str, dict[str, float]]:
    """Per timed step and collective (as the comms logger names them): MB sent and ms spent."""
    from slipstream import comm

    out = {}
    for name, sizes in comm.comms_logger.records.items():
        out[name] = {
            "MB": round(sum(s.total_bytes for s in sizes.values()) / steps / 1e6, 2),
            "ms": round(sum(s.total_latency_s for s in sizes.values()) / steps * 1e3, 2),
        }
    return out


def _logged_comms(
    step: Any, input_ids: torch.Tensor, labels: torch.Tensor, steps: int, sync: Any
) -> dict[str, dict[str, float]]:
    """``steps`` more steps with the comms logger on, every collective timed to completion
    (an async one is waited for inside the logger, so its ms is its own transfer, not the time
    to issue it); returns the per-step MB and ms of each collective."""
    from slipstream import comm

    logger = comm.comms_logger
    original = logger.run_logged

    def run_logged(op: str, call: Any, *, async_op: bool = False, **kwargs: Any) -> Any:
        if not async_op:
            return original(op, call, async_op=False, **kwargs)

        def blocking() -> Any:
            work = call()
            if work is not None:
                work.wait()  # the caller's own wait() later returns at once
            return work

        return original(op, blocking, async_op=False, **kwargs)

    logger.run_logged = run_logged  # type: ignore[method-assign]
    logger.configure(enabled=True)
    logger.reset()
    try:
        for _ in range(steps):
            step(input_ids, labels)
        sync()
        return _comms_summary(steps)
    finally:
        logger.configure(enabled=False)
        logger.run_logged = original  # type: ignore[method-assign]


def _use_ulysses(engine: Any, model: Any) -> None:
    """--sp: every block's attention becomes Ulysses attention over the engine's SP group
    (q/k/v are [batch, heads, seq/SP, head_dim]: heads are dimension 1, the sequence 2)."""
    from slipstream.comm.sequence import DistributedAttention

    for block in model.blocks:
        local = block.attend
        block.attend = DistributedAttention(
            local, engine.seq_parallel_group, scatter_idx=1, gather_idx=2
        )


def _offload_blocks(args: argparse.Namespace) -> dict[str, Any]:
    """``--offload cpu|nvme`` (optimizer) and ``--offload-param cpu|nvme`` (stage 3)."""
    blocks: dict[str, Any] = {}
    if args.offload == "cpu":
        blocks["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        ours = (
            args.offload_ratio != 1.0,
            args.offload_gpu_share,
            args.overlap_forward,
            args.offload_threads,
            args.cpu_schedule,
            args.gil_switch_us is not None,
            args.overlap_bucket_size,
            args.merge_bucket_size is not None,
            args.upload_model_dtype,
            args.cpu_stores is not None,
            args.cpu_prefetch is not None,
        )
        if args.impl == "deepspeed" and any(ours):
            raise SystemExit(
                "--offload-ratio / --offload-gpu-share / --overlap-forward / --offload-threads "
                "/ --cpu-schedule / --gil-switch-us / --overlap-bucket-size / --merge-bucket-size "
                "/ --upload-model-dtype / --cpu-stores / --cpu-prefetch: slipstream only"
            )
        if args.gil_switch_us is not None:
            blocks["offload_optimizer"]["gil_switch_interval_us"] = args.gil_switch_us
        if args.overlap_bucket_size:
            blocks["offload_optimizer"]["overlap_bucket_size"] = int(args.overlap_bucket_size)
        if args.merge_bucket_size is not None:
            blocks["offload_optimizer"]["merge_bucket_size"] = int(args.merge_bucket_size)
        if args.upload_model_dtype:
            blocks["offload_optimizer"]["upload_model_dtype"] = True
        if args.offload_threads:
            blocks["offload_optimizer"]["threads"] = args.offload_threads
        if args.cpu_schedule:
            blocks["offload_optimizer"]["cpu_schedule"] = args.cpu_schedule
        if args.cpu_stores is not None:
            blocks["offload_optimizer"]["cpu_stores"] = args.cpu_stores
        if args.cpu_prefetch is not None:
            blocks["offload_optimizer"]["cpu_prefetch"] = args.cpu_prefetch
        if args.offload_ratio != 1.0:
            blocks["offload_optimizer"]["ratio"] = args.offload_ratio
        if args.offload_gpu_share:
            blocks["offload_optimizer"]["gpu_share"] = args.offload_gpu_share
        if args.overlap_forward:
            blocks["offload_optimizer"]["overlap_forward"] = True
    elif args.offload == "nvme":
        blocks["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": str(args.nvme_path),
            "pin_memory": True,
            "pipeline_read": True,
            "pipeline_write": True,
        }
        blocks["sub_group_size"] = 2e8
    if args.offload_param == "cpu":
        blocks["offload_param"] = {"device": "cpu", "pin_memory": True}
    elif args.offload_param == "nvme":
        blocks["offload_param"] = {
            "device": "nvme",
            "nvme_path": str(args.nvme_path),
            "pin_memory": True,
        }
    return blocks


def _build(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any, Any]:
    """Returns (step_fn(input_ids, labels) -> loss, model, parameter count)."""
    shape = SHAPES[args.model]
    amp_dtype = torch.bfloat16
    if args.impl in ("slipstream", "deepspeed"):
        config = _slipstream_config(args)
        init: Any = contextlib.nullcontext()
        if args.impl == "deepspeed":
            try:
                import deepspeed as front
            except ImportError:
                raise SystemExit("--impl deepspeed: DeepSpeed is not installed") from None
            if args.stage == 3:
                init = front.zero.Init(config_dict_or_path=config)
        else:
            import slipstream as front

            if args.stage == 3 and args.mics <= 0:  # zero.Init shards over the whole world
                import slipstream.zero as zero

                init = zero.Init(config_dict_or_path=config)
        extra: dict[str, Any] = {}
        if args.tp > 1:
            # Tensor parallelism: the same model from slipstream.comm's TP layers, trained on
            # the (pipe=1, data=world/tp, tensor=tp) grid passed as the mpu.
            if args.impl != "slipstream" or args.stage == 3:
                raise SystemExit("--tp: --impl slipstream at --stage 0, 1 or 2 only")
            from llama_tp import TensorParallelLlama

            from slipstream.comm.topology import PipeModelDataParallelTopology, ProcessGrid

            world = dist.get_world_size()
            grid = ProcessGrid(
                PipeModelDataParallelTopology(num_pp=1, num_mp=args.tp, num_dp=world // args.tp)
            )
            model = TensorParallelLlama(shape, grid.group("tensor"))
            extra["mpu"] = grid
            # Count the whole model: each rank holds 1/tp of the sharded parameters.
            params = sum(p.numel() * getattr(p, "tp_size", 1) for p in model.parameters())
        else:
            with init:
                model = Llama(shape)
            params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        if args.impl == "deepspeed":
            extra["model_parameters"] = model.parameters()
        engine, *_ = front.initialize(model=model, config=config, **extra)
        if args.sp > 1:
            if args.impl != "slipstream":
                raise SystemExit("--sp: Ulysses attention is wired for --impl slipstream only")
            _use_ulysses(engine, model)

        def step(input_ids: torch.Tensor, labels: torch.Tensor, mark: Any = None) -> torch.Tensor:
            mark = mark or _no_mark
            loss = engine(input_ids, labels)
            mark("forward")
            engine.backward(loss)
            mark("backward")
            engine.step()
            mark("step")
            return loss

        return step, engine, params

    with torch.device(device):
        model = Llama(shape)
    params = sum(p.numel() for p in model.parameters())
    if args.impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    elif args.impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        wrapped = model
    else:
        raise SystemExit(f"--impl {args.impl!r}: expected ddp, fsdp2, slipstream or deepspeed")
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=fused)
    autocast = args.impl == "ddp"

    def step(input_ids: torch.Tensor, labels: torch.Tensor, mark: Any = None) -> torch.Tensor:
        mark = mark or _no_mark
        with torch.autocast(device.type, dtype=amp_dtype, enabled=autocast):
            loss = wrapped(input_ids, labels)
        mark("forward")
        loss.backward()
        mark("backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark("step")
        return loss

    step.optimizer = optimizer  # type: ignore[attr-defined]
    return step, wrapped, params


def _no_mark(phase: str) -> None:
    """A step's phase boundary when no memory timeline is recording."""


def _memory_phases(
    step: Any, engine: Any, input_ids: Any, labels: Any, device: torch.device, snapshot: Any
) -> dict[str, Any]:
    """One more step with the allocated/peak bytes at each phase boundary (memory_timeline.py),
    and what persists between steps by kind; rank 0 dumps an allocator snapshot if asked."""
    from memory_timeline import MemoryTimeline, state_bytes

    record = snapshot is not None and device.type == "cuda" and dist.get_rank() == 0
    if record:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    timeline = MemoryTimeline(device)
    states = state_bytes(engine, getattr(step, "optimizer", None))
    step(input_ids, labels, timeline.mark)
    getattr(engine, "wait_for_step", lambda: None)()
    if record:
        torch.cuda.memory._dump_snapshot(str(snapshot))
        torch.cuda.memory._record_memory_history(enabled=None)
    return {"memory_phases": timeline.summary(), "memory_states": states}


def _offload_of(engine: Any) -> Any:
    """The engine's OffloadedStep (CPU optimizer offload at stages 1-2), else None."""
    zero = getattr(engine, "zero", None)
    optimizer = getattr(zero, "optimizer", None)
    return getattr(optimizer, "offload", None)


def _outside_allocator_gib(engine: Any) -> float:
    """GiB of device memory this rank's gradient path holds outside the caching allocator
    (``publish_buffer_cuda`` of its memory report: the copy-engine publish's symmetric
    parameter buffer); 0 for engines without a slipstream gradient path."""
    path = getattr(engine, "gradient_path", None)
    report = path.memory_report() if hasattr(path, "memory_report") else {}
    return float(report.get("publish_buffer_cuda", 0)) / 2**30


def _speculation_of(engine: Any) -> Any:
    """CPU offload under clipping: the speculative step's counters, else None."""
    offload = _offload_of(engine)
    return getattr(offload, "speculation", None) if getattr(offload, "speculative", 0) else None


def _counts(stats: Any) -> dict[str, int]:
    """Speculative steps kept / discarded (cancelled: of those, called off early) / paused."""
    if stats is None:
        return {}
    names = ("kept", "discarded", "cancelled", "paused")
    return {name: int(getattr(stats, name)) for name in names}


def _phase_times(engine: Any, input_ids: Any, labels: Any, sync: Any) -> dict[str, Any]:
    """Forward, backward and step of two more steps, each phase timed alone (median of 2)."""
    times: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    for _ in range(2):
        start = time.perf_counter()
        loss = engine(input_ids, labels)
        sync()
        times["forward"].append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.backward(loss)
        sync()
        times["backward"].append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.step()
        sync()
        times["step"].append(time.perf_counter() - start)
    norm = engine.get_global_grad_norm()
    return {
        "phases_ms": {k: round(1e3 * min(v), 1) for k, v in times.items()},
        "grad_norm": None if norm is None else round(float(norm), 4),
    }


def _profile(
    args: argparse.Namespace,
    step: Any,
    input_ids: Any,
    labels: Any,
    sync: Any,
    wait_for_step: Any,
    rank: int,
) -> list[dict[str, Any]]:
    """--profile: a few more steps under torch.profiler; rank 0 prints every rank's summary."""
    from profile_steps import format_summary, profile

    def one() -> None:
        step(input_ids, labels)
        wait_for_step()

    dist.barrier()
    summary = profile(
        one, sync, steps=args.profile_steps, path=args.profile, rank=rank, stack=args.profile_stack
    )
    summaries: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(summaries, summary)
    if rank == 0:
        for index, each in enumerate(summaries):
            print(format_summary(index, each), flush=True)
        print(f"PROFILE trace of rank 0: {args.profile}", flush=True)
    return summaries


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark; rank 0 prints and records the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--impl", required=True, choices=["ddp", "fsdp2", "slipstream", "deepspeed"]
    )
    parser.add_argument(
        "--stage", type=int, default=0, help="ZeRO stage for --impl slipstream|deepspeed"
    )
    parser.add_argument("--model", default="1.3b", choices=sorted(SHAPES))
    parser.add_argument("--micro", type=int, default=4, help="micro-batch per GPU")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None, help="append the JSON result here")
    parser.add_argument("--offload", choices=["none", "cpu", "nvme"], default="none")
    parser.add_argument(
        "--offload-param",
        choices=["none", "cpu", "nvme"],
        default="none",
        help="stage 3: where the parameter shards live",
    )
    parser.add_argument(
        "--offload-ratio",
        type=float,
        default=1.0,
        help="--offload cpu: offload_optimizer.ratio (the share of the optimizer offloaded; "
        "the first parameters' masters and states stay on the GPU)",
    )
    parser.add_argument(
        "--offload-gpu-share",
        type=float,
        default=0.0,
        help="--offload cpu: offload_optimizer.gpu_share (the share of the CPU step's elements "
        "stepped on the GPU instead, states streamed from and back to host memory)",
    )
    parser.add_argument(
        "--overlap-forward",
        action="store_true",
        help="--offload cpu: offload_optimizer.overlap_forward (the CPU step's last buckets "
        "finish during the next forward)",
    )
    parser.add_argument(
        "--offload-threads",
        type=int,
        default=0,
        help="--offload cpu: offload_optimizer.threads (0: chosen from the cores)",
    )
    parser.add_argument(
        "--cpu-schedule",
        choices=["static", "dynamic"],
        default=None,
        help="--offload cpu: offload_optimizer.cpu_schedule",
    )
    parser.add_argument(
        "--cpu-stores",
        choices=["stream_out", "mixed", "stream"],
        default=None,
        help="--offload cpu: offload_optimizer.cpu_stores (default: the config's)",
    )
    parser.add_argument(
        "--cpu-prefetch",
        type=int,
        default=None,
        help="--offload cpu: offload_optimizer.cpu_prefetch, elements (default: the config's)",
    )
    parser.add_argument(
        "--gil-switch-us",
        type=float,
        default=None,
        help="--offload cpu: offload_optimizer.gil_switch_interval_us (Python's switch interval "
        "while the CPU step's worker runs; 0: Python's own; unset: the config default)",
    )
    parser.add_argument(
        "--overlap-bucket-size",
        type=float,
        default=0,
        help="--offload cpu: offload_optimizer.overlap_bucket_size (0: the config default, 1e8)",
    )
    parser.add_argument(
        "--merge-bucket-size",
        type=float,
        default=None,
        help="--offload cpu: offload_optimizer.merge_bucket_size (elements per merged C++ call "
        "of landed buckets; 0: one call per bucket; unset: the config default)",
    )
    parser.add_argument(
        "--upload-model-dtype",
        action="store_true",
        help="--offload cpu: offload_optimizer.upload_model_dtype (upload a bf16 copy the CPU "
        "step writes instead of the fp32 master)",
    )
    parser.add_argument("--nvme-path", type=Path, default=Path("/tmp/slipstream-nvme"))
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0: off)")
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree (--impl slipstream): the model from TP layers "
        "(llama_tp.py), data-parallel size world/tp; tokens/s counts each DP replica once",
    )
    parser.add_argument(
        "--comm-dtype",
        choices=["fp32", "bf16"],
        default=None,
        help="slipstream: communication_data_type (default: unset, i.e. fp32; DeepSpeed's "
        "default under bf16 is bf16)",
    )
    parser.add_argument(
        "--timeline",
        type=Path,
        default=None,
        help="--offload cpu: write host timestamps of the last timed step to PATH.rank<r>.json "
        "and print each rank's summary (tools/bench/offload_timeline.py)",
    )
    parser.add_argument(
        "--reduce-bucket-size",
        type=float,
        default=5e8,
        help="zero_optimization.reduce_bucket_size (the DeepSpeed config of BENCHMARKS.md: 5e8)",
    )
    parser.add_argument(
        "--leaf-blocks",
        action="store_true",
        help="slipstream stage 3: zero_optimization.leaf_module with the model's Block class "
        "(one all-gather per transformer block, as FSDP2 wraps it, not one per linear layer)",
    )
    parser.add_argument(
        "--allgather-bucket-size",
        type=float,
        default=5e8,
        help="zero_optimization.allgather_bucket_size (stages 1-2: elements per all-gather of "
        "the updated shards; the DeepSpeed config of BENCHMARKS.md: 5e8)",
    )
    parser.add_argument(
        "--publish-during-forward",
        action="store_true",
        help="slipstream stages 1-2: zero_optimization.publish_during_forward (the updated "
        "shards' all-gathers land as the next forward reaches them)",
    )
    parser.add_argument(
        "--copy-engine",
        action="store_true",
        help='slipstream stages 1-2: zero_optimization.publish_transport "copy_engine" (the '
        "updated shards are pulled with peer copies out of a symmetric-memory parameter "
        "buffer; with --publish-during-forward they land as the next forward reaches them)",
    )
    parser.add_argument(
        "--avg-in-rs",
        action="store_true",
        help="slipstream stages 1-2: zero_optimization.average_in_reduce_scatter (NCCL's AVG "
        "in the gradient reduce-scatter instead of a post-scale pass over each bucket)",
    )
    parser.add_argument(
        "--max-ctas",
        type=int,
        default=0,
        help="slipstream stages 1-2: zero_optimization.reduce_scatter_max_ctas (the gradient "
        "reduce-scatters on a communicator limited to this many CTAs; 0: NCCL's choice)",
    )
    parser.add_argument(
        "--reduce-bucket-tail",
        type=float,
        default=0,
        help="slipstream stages 1-2: zero_optimization.reduce_bucket_tail_size (the last "
        "reduce-scatter bucket split into buckets of at most this many elements; 0: off)",
    )
    parser.add_argument(
        "--stage3-bucket-parts",
        type=int,
        default=None,
        help="slipstream: zero_optimization.stage3_reduce_bucket_parts (unset: Slipstream's "
        "default, 64; 0: reduce_bucket_size alone)",
    )
    parser.add_argument(
        "--memory-phases",
        action="store_true",
        help="one more step after the timed ones with the allocated and peak GPU memory at "
        "each phase boundary (forward, backward, step) and the model states by kind "
        "(memory_timeline.py): where the peak comes from",
    )
    parser.add_argument(
        "--memory-snapshot",
        type=Path,
        default=None,
        help="with --memory-phases: rank 0's allocator history of that step, for "
        "https://pytorch.org/memory_viz",
    )
    parser.add_argument(
        "--no-phases",
        dest="phases",
        action="store_false",
        help="skip the two extra phase-timed steps (for runs whose steps take minutes)",
    )
    parser.add_argument(
        "--sp",
        type=int,
        default=1,
        help="slipstream: sequence_parallel_size (Ulysses); each rank runs --seq/SP tokens of "
        "its replica's sequences, tokens/s counts each token once",
    )
    parser.add_argument(
        "--qwz", action="store_true", help="stage 3: zero_quantized_weights (int8 all-gather)"
    )
    parser.add_argument(
        "--qgz",
        action="store_true",
        help="stage 3: zero_quantized_gradients (int8 all-to-all reduce-scatter)",
    )
    parser.add_argument(
        "--qgz-bits",
        type=int,
        choices=(4, 8),
        default=8,
        help="--qgz: zero_quantized_gradients_bits (4: int4 codes, two per byte)",
    )
    parser.add_argument("--mics", type=int, default=-1, help="stage 3: mics_shard_size")
    parser.add_argument("--hpz", type=int, default=1, help="stage 3: zero_hpz_partition_size")
    parser.add_argument(
        "--comms-log",
        action="store_true",
        help="slipstream: after the (unlogged) timed steps, --comms-steps more with the "
        "comms_logger on; the result gets each collective's MB and ms per step (every op, "
        "async ones too, timed to completion one at a time: no overlap in those steps)",
    )
    parser.add_argument(
        "--comms-steps", type=int, default=2, help="--comms-log: the logged steps (default 2)"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="after the timed steps, --profile-steps more under torch.profiler: rank 0's chrome "
        "trace to PATH, and every rank's summary (step wall time, GPU busy / idle, compute, NCCL, "
        "exposed communication, top kernels, host syncs) printed by rank 0 (profile_steps.py)",
    )
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument(
        "--profile-stack",
        action="store_true",
        help="with --profile: record Python stacks too (adds host overhead) and list the "
        "library's Python functions by inclusive time (the engine's hooks)",
    )
    args = parser.parse_args(argv)
    if "nvme" in (args.offload, args.offload_param):
        args.nvme_path.mkdir(parents=True, exist_ok=True)

    device, rank, world = _setup()
    torch.manual_seed(0)
    step, engine, params = _build(args, device)
    shape = SHAPES[args.model]
    # --sp: the ranks of one SP group share their replica's sequences (seeded by the DP
    # index) and each takes its contiguous slice; labels are shifted before slicing.
    # Tensor-parallel ranks of one replica read the same batch (they are adjacent ranks).
    replica, piece = divmod(rank // args.tp, args.sp)
    generator = torch.Generator(device="cpu").manual_seed(1234 + replica)
    tokens = torch.randint(0, shape.vocab, (args.micro, args.seq + 1), generator=generator)
    local = slice(piece * args.seq // args.sp, (piece + 1) * args.seq // args.sp)
    input_ids, labels = tokens[:, :-1][:, local].to(device), tokens[:, 1:][:, local].to(device)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # overlap_forward leaves each step's end to the next forward: the window starts with
    # nothing left over from the warm-up and ends once its last step is done.
    wait_for_step = getattr(engine, "wait_for_step", lambda: None)
    try:
        for _ in range(args.warmup):
            step(input_ids, labels)
    except torch.OutOfMemoryError as error:
        # The answer to "does this length fit?" (--sp runs): one line, not a traceback.
        if rank == 0:
            result = {"impl": args.impl, "model": args.model, "micro": args.micro}
            result.update(seq=args.seq, sp=args.sp, world=world, stage=args.stage, oom=True)
            print("BENCH " + json.dumps({**result, "error": str(error)[:200]}), flush=True)
        return 3
    wait_for_step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    offload = _offload_of(engine)
    busy = (offload.worker_busy_s, offload.tail_wait_s) if offload is not None else None
    kernel_before = offload.kernel_s if offload is not None else None
    off_worker_before = getattr(offload, "kernel_off_worker_s", None)
    calls_before = getattr(offload, "worker_calls", 0)
    timeline = None
    if args.timeline is not None and offload is not None:
        from offload_timeline import Timeline

        timeline = Timeline()
        timeline.install(engine)
    stats = _speculation_of(engine)
    before = _counts(stats)
    if args.comms_log:
        from slipstream import comm

        # The timed window runs unlogged (the logger synchronises around every op); the
        # logged steps come after it (_logged_comms).
        comm.comms_logger.configure(enabled=False)
    start = time.perf_counter()
    ends = []
    for _ in range(args.steps):
        if timeline is not None:
            timeline.begin_step()
        loss = step(input_ids, labels)
        ends.append(time.perf_counter())  # host time: the GPU may still be behind it
    wait_for_step()
    sync()
    elapsed = time.perf_counter() - start
    comms = _logged_comms(step, input_ids, labels, args.comms_steps, sync) if args.comms_log else {}
    step_ms = [round(1e3 * (b - a), 1) for a, b in zip([start, *ends[:-1]], ends, strict=True)]
    timed_speculation = (
        None if stats is None else {k: v - before[k] for k, v in _counts(stats).items()}
    )
    if timeline is not None:
        timeline.uninstall()
        summary = timeline.dump(args.timeline, rank)
        print(f"TIMELINE rank {rank} {json.dumps(summary)}", flush=True)
    cpu_step = {}
    if offload is not None and busy is not None:
        # Per timed step: how long the CPU worker stepped buckets (during backward and, with
        # overlap_forward, after step() returned), and how long forwards waited for it.
        cpu_step = {
            "cpu_worker_calls": round((offload.worker_calls - calls_before) / args.steps, 1),
            "cpu_worker_busy_ms": round(1e3 * (offload.worker_busy_s - busy[0]) / args.steps, 1),
            "forward_wait_ms": round(1e3 * (offload.tail_wait_s - busy[1]) / args.steps, 1),
        }
        if kernel_before is not None:
            # The C++ Adam's own clock: time inside its parallel regions per step (the rest of
            # cpu_worker_busy_ms is Python, the GIL and waits for landing buckets), and how late
            # the last OpenMP thread ended against the mean (1.0: together).
            kernel = [b - a for a, b in zip(kernel_before, offload.kernel_s, strict=True)]
            cpu_step["cpu_kernel_ms"] = round(1e3 * kernel[0] / args.steps, 1)
            cpu_step["cpu_straggle"] = round(kernel[1] / kernel[2], 3) if kernel[2] > 0 else None
            # Per step, summed over the calls: how long each region waited for its last thread to
            # start (a descheduled or sleeping OpenMP thread starts late).
            cpu_step["cpu_late_start_ms"] = round(1e3 * kernel[3] / args.steps, 1)
        if off_worker_before is not None:
            # The part of cpu_kernel_ms run off the worker (so not in cpu_worker_busy_ms): steps
            # after backward, when a speculative step was discarded or paused (clipping).
            off = offload.kernel_off_worker_s - off_worker_before
            cpu_step["cpu_kernel_off_worker_ms"] = round(1e3 * off / args.steps, 1)
    final_loss = float(loss)  # host sync once, after timing
    timed_phases = args.impl in ("slipstream", "deepspeed") and args.phases
    phases = _phase_times(engine, input_ids, labels, sync) if timed_phases else {}
    # The timed steps' peaks, read before the memory timeline's step resets the peak counters.
    peak = torch.tensor(
        [
            torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0,
            torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else 0.0,
        ],
        device=device,
    )
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    # Memory the caching allocator does not count: the copy-engine publish's symmetric
    # buffer, where ZeRO-1/2's parameters live (max_memory_allocated leaves it out).
    outside = torch.tensor([_outside_allocator_gib(engine)], device=device)
    dist.all_reduce(outside, op=dist.ReduceOp.MAX)
    if args.profile is not None:
        summaries = _profile(args, step, input_ids, labels, sync, wait_for_step, rank)
        keys = ("wall_ms", "busy_ms", "idle_ms", "compute_ms", "comm_ms", "exposed_comm_ms")
        phases["profile"] = [{k: each[k] for k in keys} for each in summaries]
    if args.memory_phases:
        phases.update(_memory_phases(step, engine, input_ids, labels, device, args.memory_snapshot))

    replicas = world // (args.tp * args.sp)
    tokens_per_s = args.steps * args.micro * args.seq * replicas / elapsed
    flops = shape.flops_per_token(args.seq, params)
    # Host memory: the peak resident set of rank 0's process (pinned memory counts), and the
    # page-locked bytes the offload path's arena holds, if any.
    host_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    masters = getattr(getattr(engine, "zero", None), "masters", None)
    arena = getattr(masters, "host", None)
    result = {
        "impl": args.impl
        if args.impl not in ("slipstream", "deepspeed")
        else f"{args.impl}-zero{args.stage}"
        + (f"+{args.offload}" if args.offload != "none" else "")
        + {"none": "", "cpu": "+param", "nvme": "+nvmeparam"}[args.offload_param]
        + ("+noclip" if args.clip == 0 else "")
        + (f"+{args.comm_dtype}comm" if args.comm_dtype else "")
        + (f"+ratio{args.offload_ratio:g}" if args.offload_ratio != 1.0 else "")
        + (f"+gs{args.offload_gpu_share:g}" if args.offload_gpu_share else "")
        + ("+ovf" if args.overlap_forward else "")
        + (f"+t{args.offload_threads}" if args.offload_threads else "")
        + ({"dynamic": "+dyn", "static": "+static"}.get(args.cpu_schedule or "", ""))
        + (f"+st{args.cpu_stores}" if args.cpu_stores else "")
        + (f"+cpf{args.cpu_prefetch}" if args.cpu_prefetch is not None else "")
        + (f"+si{args.gil_switch_us:g}" if args.gil_switch_us is not None else "")
        + (f"+ob{args.overlap_bucket_size:g}" if args.overlap_bucket_size else "")
        + (f"+mb{args.merge_bucket_size:g}" if args.merge_bucket_size is not None else "")
        + ("+up16" if args.upload_model_dtype else "")
        + (f"+rb{args.reduce_bucket_size:g}" if args.reduce_bucket_size != 5e8 else "")
        + (f"+ab{args.allgather_bucket_size:g}" if args.allgather_bucket_size != 5e8 else "")
        + ("+pf" if args.publish_during_forward else "")
        + ("+ce" if args.copy_engine else "")
        + (f"+ctas{args.max_ctas}" if args.max_ctas else "")
        + ("+avg" if args.avg_in_rs else "")
        + (f"+tail{args.reduce_bucket_tail:g}" if args.reduce_bucket_tail else "")
        + ("+leaf" if args.leaf_blocks else "")
        + (f"+tp{args.tp}" if args.tp > 1 else ""),
        "model": args.model,
        "params": params,
        "micro": args.micro,
        "seq": args.seq,
        "sp": args.sp,
        "zero_plus_plus": _zero_plus_plus(args),
        **({"comms_per_step": comms} if comms else {}),
        "world": world,
        "tp": args.tp,
        "global_batch": args.micro * replicas,
        "tokens_per_s": round(tokens_per_s, 1),
        "tflops_per_gpu": round(tokens_per_s / world * flops / 1e12, 1),
        "peak_alloc_gib": round(float(peak[0]), 2),
        "peak_reserved_gib": round(float(peak[1]), 2),
        # peak_alloc_gib is the caching allocator's peak; symmetric_gib the buffer beside it
        # (copy-engine publish); peak_with_symmetric_gib their sum, comparable to FSDP2's.
        "symmetric_gib": round(float(outside[0]), 2),
        "peak_with_symmetric_gib": round(float(peak[0] + outside[0]), 2),
        "loss": round(final_loss, 4),
        "host_peak_gib": round(host_peak, 1),
        "pinned_arena_gib": round(arena.reserved_bytes / 2**30, 1) if arena is not None else None,
        "speculation": None if stats is None else _counts(stats),
        # The same within the timed window: a step that did not keep its speculative step
        # (discarded, or paused by the back-off early in a run) ran its CPU step after backward.
        "speculation_timed": timed_speculation,
        "step_ms": step_ms,
        **phases,
        **cpu_step,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    if rank == 0:
        if "memory_phases" in result:
            memory = result["memory_phases"]
            print(
                f"MEMORY peak {memory['peak_gib']} GiB in {memory['peak_phase']}; between steps "
                f"{memory['start_gib']} GiB = {result['memory_states']}; phases "
                f"{memory['phases']}",
                flush=True,
            )
        print("BENCH " + json.dumps(result), flush=True)
        if args.out is not None:
            with args.out.open("a") as handle:
                handle.write(json.dumps(result) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
