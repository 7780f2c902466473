"""`slipstream estimate`: the model-state formulas against bytes measured from real tensors."""

from __future__ import annotations

import pytest
import torch

from slipstream.cli import main
from slipstream.runtime.estimate import estimate_activations, estimate_model_states


def test_stage0_fp32_estimate_matches_measured_tensors() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 16))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 64)).sum().backward()
    optimizer.step()
    params = list(model.parameters())
    measured_params = sum(p.untyped_storage().nbytes() for p in params)
    measured_grads = sum(p.grad.untyped_storage().nbytes() for p in params)
    measured_states = sum(
        v.untyped_storage().nbytes()
        for state in optimizer.state.values()
        for v in state.values()
        if v.dim() > 0
    )
    row = estimate_model_states(sum(p.numel() for p in params), 1, param_bytes=4)[0]
    assert (row.params, row.grads, row.optimizer) == (
        measured_params,
        measured_grads,
        measured_states,
    )


@pytest.mark.parametrize("param_bytes", [2, 4])
def test_each_stage_needs_less_per_rank(param_bytes: int) -> None:
    rows = estimate_model_states(1_000_000, 8, param_bytes=param_bytes)
    assert [r.stage for r in rows] == [0, 1, 2, 3]
    assert rows[0].total > rows[1].total > rows[2].total > rows[3].total
    # Stage 3: the fp32 master shard is the parameter shard (no model-dtype copy beside it).
    assert rows[3].params == 4 * 1_000_000 / 8
    assert rows[3].total == (4 + 4 + 8) * 1_000_000 / 8


def test_activation_checkpointing_keeps_only_layer_inputs() -> None:
    full = estimate_activations(hidden=1024, layers=24, seq=1024, micro_batch=2, heads=16)
    assert full.total == 24 * full.per_layer
    assert full.checkpointed_total < full.total / 5
    with pytest.raises(ValueError, match="heads=0"):
        estimate_activations(hidden=1024, layers=24, seq=1024, micro_batch=2, heads=0)


def test_estimate_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "estimate",
                "--hidden",
                "2048",
                "--layers",
                "24",
                "--heads",
                "16",
                "--seq",
                "2048",
                "--micro-batch",
                "4",
                "--num-gpus",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "1.311 B parameters, 2 data-parallel rank(s)" in out
    assert out.count("\n") >= 6 and "activations per rank" in out
    # 2 bytes per parameter of this rank's shard: 1.311e9 * 2 / 2 ranks = 1.22 GiB.
    assert "accumulation): - 1.22 GiB host per rank" in out
    assert "offload_optimizer.ratio" not in out
    assert main(["estimate", "--params", "1e9", "--num-gpus", "2", "--offload-ratio", "0.5"]) == 0
    out = capsys.readouterr().out
    # Half of each rank's 5e8 elements stay: 16 B each on the GPU (fp32 master, Adam's two
    # moments, fp32 gradient) = 3.73 GiB; at stages 1-2 under clipping the host also loses
    # the speculative spares (12 B each).
    assert "ratio 0.5 (CPU): up to + 3.73 GiB GPU and - 3.73 GiB host per rank" in out
    assert "(- 2.79 GiB more with gradient_clipping at stages 1-2)" in out
    assert main(["estimate", "--params", "1e9", "--offload-ratio", "2"]) == 2
    assert main(["estimate"]) == 2


def test_transformer_params_counts_a_real_swiglu_decoder() -> None:
    from torch import nn

    from slipstream.runtime.estimate import transformer_params

    hidden, layers, vocab, ffn = 48, 3, 101, 80

    def block() -> nn.ModuleList:
        return nn.ModuleList(
            [
                nn.Linear(hidden, 3 * hidden, bias=False),  # fused QKV
                nn.Linear(hidden, hidden, bias=False),  # output projection
                nn.Linear(hidden, 2 * ffn, bias=False),  # SwiGLU gate and value
                nn.Linear(ffn, hidden, bias=False),  # down
            ]
        )

    model = nn.ModuleList(
        [
            nn.Embedding(vocab, hidden),
            *(block() for _ in range(layers)),
            nn.Linear(hidden, vocab, bias=False),
        ]
    )
    counted = sum(p.numel() for p in model.parameters())
    assert transformer_params(hidden, layers, vocab, ffn=ffn, gated=True, tied=False) == counted
    # GPT defaults: 4h MLP, tied embedding.
    assert transformer_params(hidden, layers, vocab) == 12 * layers * hidden**2 + vocab * hidden


def test_offload_estimate_matches_what_offload_allocates() -> None:
    from slipstream.runtime.estimate import estimate_offload

    gib = 1024.0**3
    # 7b on one GPU, bf16, Adam, offload_param: the host holds masters, moments, fp32 grads and
    # bf16 shards (18 B per parameter): about 113 GiB, which fit the 256 GiB benchmark host.
    rows = {(r.stage, r.param_offload): r for r in estimate_offload(6_738_415_616, 1)}
    assert rows[(3, True)].gpu == 0
    assert rows[(3, True)].host / gib == pytest.approx(6_738_415_616 * 18 / gib)
    # No staging copy on the CPU: every stage uploads the fp32 masters and casts on the GPU.
    assert rows[(3, False)].host == pytest.approx(16 * 6_738_415_616)
    assert rows[(2, False)].host == pytest.approx(16 * 6_738_415_616)
    assert rows[(2, False)].gpu == pytest.approx(2 * 6_738_415_616)
    assert rows[(1, False)].gpu == pytest.approx(6 * 6_738_415_616)  # + fp32 accumulators
    # The speculative step (clipping, stages 1-2 on the CPU): fp32 master + two moments again.
    assert rows[(2, False)].speculation_host == pytest.approx(12 * 6_738_415_616)
    assert rows[(3, False)].speculation_host == 0
    nvme = {
        (r.stage, r.param_offload): r
        for r in estimate_offload(1000, 2, device="nvme", param_device="nvme")
    }
    assert nvme[(2, False)].nvme == pytest.approx(12 * 1000 / 2)
    assert nvme[(2, False)].host == pytest.approx(6 * 1000 / 2)  # fp32 grads + staged copy
    assert nvme[(2, False)].speculation_host == 0  # NVMe steps after backward
    # offload_param to NVMe: the bf16 shards are disk bytes, not host bytes.
    assert nvme[(3, True)].host == pytest.approx(4 * 1000 / 2)  # fp32 grads only
    assert nvme[(3, True)].nvme == pytest.approx(14 * 1000 / 2)
    both = estimate_offload(1000, 2, device="nvme", param_device="nvme")
    assert {(r.stage, r.param_offload): r for r in both}[(3, False)] == nvme[(3, False)]
    cpu_params = estimate_offload(1000, 2, device="nvme", param_device="cpu")
    assert {(r.stage, r.param_offload): r for r in cpu_params}[(3, True)].host == 6 * 1000 / 2


def test_the_13b_offload_row_fits_two_80gb_gpus_and_a_256gb_host() -> None:
    """The bench row slipstream:3+cpu+bf16comm@13b/1 (tools/bench/llama.py's 13b) on 2 ranks
    of one node: GPU model states plus activations under 80 GB, the node's host total (the
    per-node line) under 256 GB."""
    from slipstream.runtime.estimate import (
        estimate_offload,
        format_estimate,
        transformer_params,
    )

    params = transformer_params(5120, 40, 32000, ffn=13824, gated=True, tied=False)
    assert 12.9e9 < params < 13.1e9
    stage3 = next(
        r
        for r in estimate_offload(params, 2, 2, device="cpu")
        if r.stage == 3 and not r.param_offload
    )
    activations = estimate_activations(5120, 40, 2048, 1, 40, bytes_per_value=2)
    gib = 1024.0**3
    assert (stage3.gpu + activations.total) / gib < 80 * 1e9 / gib
    host_per_rank = stage3.host - 2 * params / 2  # bf16 gradients land in bf16
    assert 2 * host_per_rank < 256e9 * 0.8  # leave a fifth for the processes themselves
    text = format_estimate(params, 2, 2, activations, ranks_per_node=2)
    assert (
        f"stage 3 {2 * stage3.host / gib:.2f} GiB ({2 * host_per_rank / gib:.2f} with bf16" in text
    )
