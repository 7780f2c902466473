"""Memory estimates per rank: model states at each ZeRO stage, and transformer activations.

The model-state figures follow what this implementation allocates (not ZeRO paper's ideal):
with fp16/bf16, every stage keeps fp32 master weights and accumulates gradients in fp32.

==========  =================  ============================  ==========================
stage       parameters         gradients                     optimizer (masters+states)
==========  =================  ============================  ==========================
0           d·Ψ                4·Ψ (fp32)                    (m + k)·Ψ
1           d·Ψ                4·Ψ accumulators + 4·Ψ/N      (4 + k)·Ψ/N
2           d·Ψ                4·Ψ/N                         (4 + k)·Ψ/N
3           4·Ψ/N              4·Ψ/N                         k·Ψ/N
==========  =================  ============================  ==========================

Ψ parameters, N data-parallel ranks, d bytes per model parameter (2 for fp16/bf16, 4 for
fp32), m the master copy (4 with fp16/bf16, 0 in fp32 where the parameters themselves are
updated), k optimizer-state bytes per parameter (8 for Adam's two fp32 moments). In fp32 at
stages 1 and 2 the master shard is a separate fp32 copy (4·Ψ/N). At stage 3 the fp32 master
shard *is* the parameter shard in any precision (the all-gather casts it to d bytes on the way:
[Note: ZeRO-3 memory] in slipstream.zero); with optimizer offload the GPU keeps a d·Ψ/N copy.
Stage 1 keeps fp32 full-size gradient accumulators only with fp16/bf16 (in fp32 the
parameters' own ``.grad`` is that buffer, 4·Ψ).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ActivationEstimate",
    "ModelStateEstimate",
    "OffloadEstimate",
    "estimate_activations",
    "estimate_model_states",
    "estimate_offload",
]


@dataclass(frozen=True, slots=True)
class ModelStateEstimate:
    """Bytes per rank for one ZeRO stage."""

    stage: int
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        """Parameters + gradients + optimizer states."""
        return self.params + self.grads + self.optimizer


def estimate_model_states(
    num_params: int,
    world_size: int,
    param_bytes: int = 2,
    optimizer_state_bytes: int = 8,
) -> list[ModelStateEstimate]:
    """Bytes per rank for parameters, gradients and optimizer states at stages 0-3.

    ``param_bytes`` is 2 for fp16/bf16 training (fp32 masters implied) and 4 for fp32;
    ``optimizer_state_bytes`` is per parameter (Adam/AdamW: 8, SGD with momentum: 4).
    """
    if num_params <= 0 or world_size <= 0:
        raise ValueError(
            f"num_params={num_params} and world_size={world_size} must both be positive"
        )
    if param_bytes not in (2, 4):
        raise ValueError(f"param_bytes={param_bytes}: use 2 (fp16/bf16) or 4 (fp32)")
    p, n = float(num_params), float(world_size)
    mixed = param_bytes == 2
    master = 4.0 if mixed else 0.0
    k = float(optimizer_state_bytes)
    return [
        ModelStateEstimate(0, param_bytes * p, 4 * p, (master + k) * p),
        ModelStateEstimate(1, param_bytes * p, 4 * p + 4 * p / n, (4 + k) * p / n),
        ModelStateEstimate(2, param_bytes * p, 4 * p / n, (4 + k) * p / n),
        ModelStateEstimate(3, 4 * p / n, 4 * p / n, k * p / n),
    ]


@dataclass(frozen=True, slots=True)
class OffloadEstimate:
    """Bytes per rank with optimizer offload: what stays on the GPU and what moves out."""

    stage: int
    param_offload: bool
    gpu: float
    host: float
    nvme: float
    # Stages 1-2 on the CPU under gradient_clipping: the speculative step's spare buffers
    # (fp32 master and Adam's two moments, 12 bytes per element), on top of ``host``.
    speculation_host: float = 0.0


def estimate_offload(
    num_params: int,
    world_size: int,
    param_bytes: int = 2,
    optimizer_state_bytes: int = 8,
    device: str = "cpu",
    param_device: str = "cpu",
) -> list[OffloadEstimate]:
    """Model-state bytes per rank with ``offload_optimizer`` (stages 1-3, and 3 + offload_param).

    Host (``device="cpu"``): fp32 masters, optimizer states and fp32 gradients of this rank's
    shard, ``(4 + k + 4)·Ψ/N`` (the stage uploads the masters themselves and casts them on the
    device), plus, with ``offload_param``, the model-dtype shard itself: ``(4 + k + 4 + d)·Ψ/N``
    (an upper bound with ``communication_data_type`` bf16 and one reduction per step, whose
    gradients stay bf16 on the host: ``2·Ψ/N`` less). With ``device="nvme"`` the masters and
    states ``(4 + k)·Ψ/N`` go to disk instead (the sub-groups in flight come back to host
    memory), and every stage keeps a model-dtype staging copy ``d·Ψ/N`` on the host.
    With ``param_device="nvme"`` (``offload_param.device: "nvme"``) the model-dtype shards
    ``d·Ψ/N`` of the ``offload_param`` row are on disk too (the shards being gathered, read
    ahead or stepped, and those within ``max_in_cpu``, come back to host memory: not counted).
    GPU: the model-dtype parameters (all of them at stages 1-2, the shard at stage 3, none
    persistent with ``offload_param``), plus stage 1's full-size fp32 accumulators under
    fp16/bf16; gradient buckets in flight are not counted. ``speculation_host``: stages 1-2
    with ``device="cpu"`` add ``12·Ψ/N`` of host memory when ``gradient_clipping`` or fp16 is
    on (the speculative step's spare buffers, docs/offload.md).
    """
    rows = estimate_model_states(num_params, world_size, param_bytes, optimizer_state_bytes)
    p, n, d, k = (
        float(num_params),
        float(world_size),
        float(param_bytes),
        float(optimizer_state_bytes),
    )
    out = []
    for stage, param_offload in ((1, False), (2, False), (3, False), (3, True)):
        gpu = 0.0 if param_offload else rows[stage].params
        if stage == 3 and not param_offload:
            gpu = d * p / n  # the model-dtype shard (the fp32 master is on the host)
        if stage == 1 and param_bytes == 2:
            gpu += 4 * p
        masters_and_states = (4 + k) * p / n
        host = 4 * p / n  # fp32 grads
        if param_offload or device == "nvme":
            host += d * p / n  # the host shard (offload_param), or NVMe's staging copy
        nvme = 0.0
        if param_offload and param_device == "nvme":
            host -= d * p / n
            nvme += d * p / n
        if device == "nvme":
            nvme += masters_and_states
        else:
            host += masters_and_states
        spares = 12 * p / n if stage in (1, 2) and device == "cpu" else 0.0
        out.append(OffloadEstimate(stage, param_offload, gpu, host, nvme, spares))
    return out


@dataclass(frozen=True, slots=True)
class ActivationEstimate:
    """Activation bytes per rank for one micro-batch of a GPT-style transformer."""

    per_layer: float
    total: float
    checkpointed_total: float


def estimate_activations(
    hidden: int,
    layers: int,
    seq: int,
    micro_batch: int,
    heads: int,
    bytes_per_value: int = 2,
) -> ActivationEstimate:
    """Activation memory of a transformer (Korthikanti et al., 2022, no tensor parallelism).

    Per layer ``s·b·h·(34 + 5·a·s/h)`` bytes in 16-bit (attention scores included, no flash
    attention); ``bytes_per_value=4`` doubles the 16-bit terms. With full activation
    checkpointing only each layer's input (``2·s·b·h``) is kept, plus one layer's worth
    recomputed in backward.
    """
    for name, value in (
        ("hidden", hidden),
        ("layers", layers),
        ("seq", seq),
        ("micro_batch", micro_batch),
        ("heads", heads),
    ):
        if value <= 0:
            raise ValueError(f"{name}={value} must be positive")
    s, b, h, a = float(seq), float(micro_batch), float(hidden), float(heads)
    scale = bytes_per_value / 2.0
    per_layer = s * b * h * (34 + 5 * a * s / h) * scale
    checkpointed = layers * 2 * s * b * h * scale + per_layer
    return ActivationEstimate(per_layer, per_layer * layers, checkpointed)


def transformer_params(
    hidden: int,
    layers: int,
    vocab: int,
    ffn: int | None = None,
    gated: bool = False,
    tied: bool = True,
) -> int:
    """Weight-matrix parameters of a decoder: per layer 4·h² (QKV and output projection) plus
    the MLP (2·h·ffn, or 3·h·ffn when gated as SwiGLU), plus the embedding (and an untied LM
    head). Norms and biases are left out. The defaults (ffn = 4h, plain MLP, tied) give GPT's
    12·L·h² + V·h; the Llama-style 1.3b of the benchmarks is ``ffn=5504, gated=True,
    tied=False``.

    >>> transformer_params(2048, 24, 32000, ffn=5504, gated=True, tied=False) / 1e9
    1.345323008
    """
    ffn = 4 * hidden if ffn is None else ffn
    mlp = (3 if gated else 2) * hidden * ffn
    embeddings = vocab * hidden * (1 if tied else 2)
    return layers * (4 * hidden * hidden + mlp) + embeddings


def format_estimate(
    num_params: int,
    world_size: int,
    param_bytes: int,
    activations: ActivationEstimate | None = None,
    offload_ratio: float = 1.0,
    ranks_per_node: int = 1,
) -> str:
    """The table printed by ``slipstream estimate`` (``offload_ratio``: what partial CPU
    offload, ``offload_optimizer.ratio``, moves back to the GPU; ``ranks_per_node``: the
    ranks sharing one host's memory, for the per-node host total)."""
    gib = 1024.0**3
    lines = [
        f"{num_params / 1e9:.3f} B parameters, {world_size} data-parallel rank(s), "
        f"{'fp16/bf16 with fp32 masters' if param_bytes == 2 else 'fp32'}, Adam",
        f"{'stage':>5} {'params GiB':>11} {'grads GiB':>10} {'optim GiB':>10} {'total GiB':>10}",
    ]
    for row in estimate_model_states(num_params, world_size, param_bytes):
        lines.append(
            f"{row.stage:>5} {row.params / gib:>11.2f} {row.grads / gib:>10.2f} "
            f"{row.optimizer / gib:>10.2f} {row.total / gib:>10.2f}"
        )
    lines.append(
        "with offload_optimizer (CPU; NVMe moves the masters and states to disk, and with "
        "offload_param the parameter shards), per rank:"
    )
    lines.append(
        f"{'stage':>13} {'GPU GiB':>9} {'host GiB':>9} {'or: host GiB':>13} {'+ NVMe GiB':>11}"
    )
    cpu = estimate_offload(num_params, world_size, param_bytes, device="cpu")
    nvme = estimate_offload(num_params, world_size, param_bytes, device="nvme", param_device="nvme")
    for on_cpu, on_nvme in zip(cpu, nvme):
        label = f"{on_cpu.stage}{' + param' if on_cpu.param_offload else ''}"
        lines.append(
            f"{label:>13} {on_cpu.gpu / gib:>9.2f} {on_cpu.host / gib:>9.2f} "
            f"{on_nvme.host / gib:>13.2f} {on_nvme.nvme / gib:>11.2f}"
        )
    spares = cpu[1].speculation_host
    lines.append(
        f"  stages 1-2 on the CPU with gradient_clipping or fp16: + {spares / gib:.2f} GiB host "
        "per rank for the speculative step's spare buffers "
        "(offload_optimizer.speculative_step false: none)"
    )
    if param_bytes == 2:
        saved = 2 * float(num_params) / world_size
        lines.append(
            f"  with communication_data_type bf16 (at stages 2-3 without gradient "
            f"accumulation): "
            f"- {saved / gib:.2f} GiB host per rank (the gradients land in bf16)"
        )
    if ranks_per_node > 1:
        # The ranks of a node share its host memory: what the host must hold in all.
        stage3 = next(row for row in cpu if row.stage == 3 and not row.param_offload)
        low = 2 * float(num_params) / world_size if param_bytes == 2 else 0.0
        lines.append(
            f"  host memory per node ({ranks_per_node} ranks), CPU optimizer offload: stage 3 "
            f"{ranks_per_node * stage3.host / gib:.2f} GiB"
            + (
                f" ({ranks_per_node * (stage3.host - low) / gib:.2f} with bf16 communication)"
                if low
                else ""
            )
            + f", stage 2 {ranks_per_node * cpu[1].host / gib:.2f} GiB (+ the spare buffers "
            "above with clipping or fp16), plus each process's own (CUDA context, torch: a "
            "few GiB)"
        )
    if offload_ratio < 1.0:
        # The kept share's fp32 master, states and gradient come to the GPU, and at stages
        # 1-2 the speculative step's spares leave the host too.
        kept = (1.0 - offload_ratio) * float(num_params) / world_size
        lines.append(
            f"  with offload_optimizer.ratio {offload_ratio:g} (CPU): up to + {(16 * kept) / gib:.2f} "
            f"GiB GPU and - {(16 * kept) / gib:.2f} GiB host per rank "
            f"(- {(12 * kept) / gib:.2f} GiB more with gradient_clipping at stages 1-2)"
        )
    if activations is not None:
        lines.append(
            f"activations per rank: {activations.total / gib:.2f} GiB "
            f"({activations.per_layer / gib:.3f} GiB per layer); with full activation "
            f"checkpointing {activations.checkpointed_total / gib:.2f} GiB"
        )
    return "\n".join(lines)
