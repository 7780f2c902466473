"""The executor in one process (every schedule, chunks handed over in memory), the config
block and the header encoding of the point-to-point layer."""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels.config_schema import ConfigError
from slipstream.pipeline import PipelineConfig, PipelineModule, build_executor, build_schedule
from slipstream.pipeline.models import decoder_layer_specs, language_model_loss
from slipstream.pipeline.p2p import _decode, _encode
from slipstream.pipeline.runtime import eval_batch, train_batch

SPECS = decoder_layer_specs(32, 16, 4, 2, 24, tie_embeddings=True, dropout=0.1)


def _data(seed, count=4):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 32, (2, 6), generator=gen), torch.randint(0, 32, (2, 6), generator=gen))
        for _ in range(count)
    ]


@pytest.mark.parametrize(
    ("name", "virtual", "interval"),
    [
        ("gpipe", 1, 0),
        ("1f1b", 1, 0),
        ("zero_bubble", 1, 0),
        ("zero_bubble", 1, 2),
        ("interleaved_1f1b", 2, 0),
        ("interleaved_1f1b", 3, 1),
    ],
)
def test_schedules_match_plain_training(name, virtual, interval):
    module = PipelineModule(
        SPECS,
        num_stages=1,
        loss_fn=language_model_loss,
        seed_layers=True,
        virtual_stages=virtual,
        activation_checkpoint_interval=interval,
    )
    reference = PipelineModule(SPECS, num_stages=1, loss_fn=language_model_loss, seed_layers=True)
    executor = build_executor(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    schedule = build_schedule(name, 1, 4, virtual)
    for step in range(2):
        data = _data(step)
        torch.manual_seed(step)  # dropout: the same masks in both runs, micro-batch by micro-batch
        loss, norm = train_batch(executor, schedule, iter(data), optimizer, max_grad_norm=0.5)
        torch.manual_seed(step)
        total = 0.0
        for x, y in data:
            part = language_model_loss(reference(x), y) / len(data)
            part.backward()
            total += part.item()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        assert loss.item() == pytest.approx(total, rel=1e-6)
        assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-5)
        mine, theirs = module.state_dict(), reference.state_dict()
        assert mine.keys() == theirs.keys()
        for key in mine:
            torch.testing.assert_close(mine[key], theirs[key], rtol=1e-5, atol=1e-6)
    # Evaluation: no dropout, logits per micro-batch, the data iterator fully consumed.
    data = iter(_data(9))
    loss, logits = eval_batch(executor, data, 4, return_logits=True)
    reference.eval()
    with torch.no_grad():
        expected = [reference(x) for x, _ in _data(9)]
        ref_loss = sum(language_model_loss(o, y).item() for o, (_, y) in zip(expected, _data(9)))
    assert loss.item() == pytest.approx(ref_loss / 4, rel=1e-6)
    assert len(logits) == 4 and all(
        torch.allclose(a, b, atol=1e-6) for a, b in zip(logits, expected)
    )
    assert next(data, None) is None
    assert module.training  # eval_batch restores the mode
    no_loss, no_logits = eval_batch(executor, iter(_data(9)), 4, compute_loss=False)
    assert no_loss is None and no_logits is None


def test_executor_errors():
    module = PipelineModule(SPECS, num_stages=1, loss_fn=language_model_loss)
    executor = build_executor(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="ran out after 2 micro-batches"):
        train_batch(executor, build_schedule("1f1b", 1, 4), iter(_data(0, count=2)), optimizer)
    with pytest.raises(ValueError, match="data_iter is None"):
        train_batch(executor, build_schedule("1f1b", 1, 4), None, optimizer)
    with pytest.raises(ValueError, match="chunks"):
        executor.run(build_schedule("interleaved_1f1b", 1, 4, 2), iter(_data(0)))
    no_labels = PipelineModule(SPECS, num_stages=1, loss_fn=language_model_loss)
    with pytest.raises(ValueError, match="no labels"):
        build_executor(no_labels).run(
            build_schedule("1f1b", 1, 1), iter([torch.zeros(2, 3, dtype=torch.long)])
        )
    not_scalar = PipelineModule(SPECS, num_stages=1)
    with pytest.raises(TypeError, match="scalar"):
        build_executor(not_scalar).run(build_schedule("1f1b", 1, 1), iter(_data(0)))


def test_build_optimizer():
    from slipstream.pipeline import build_optimizer

    params = [torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=False)]
    adamw = build_optimizer({"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}, params)
    assert type(adamw) is torch.optim.AdamW and tuple(adamw.defaults["betas"]) == (0.9, 0.95)
    assert len(adamw.param_groups[0]["params"]) == 1  # frozen parameters are left out
    assert build_optimizer(adamw, params) is adamw
    made = build_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.5), params)
    assert type(made) is torch.optim.SGD and made.defaults["lr"] == 0.5
    with pytest.raises(ValueError, match=r"not a torch\.optim class"):
        build_optimizer({"type": "OneBitAdam"}, params)
    with pytest.raises(ValueError, match="needs 'type'"):
        build_optimizer({"params": {}}, params)
    with pytest.raises(TypeError, match="cannot make an optimizer"):
        build_optimizer(3, params)


def test_header_round_trip():
    tensors = [
        torch.zeros(2, 3, 4, requires_grad=True),
        torch.zeros(5, dtype=torch.int64),
        torch.zeros((), dtype=torch.bfloat16),
    ]
    assert _decode(_encode(tensors)) == [
        (torch.float32, True, (2, 3, 4)),
        (torch.int64, False, (5,)),
        (torch.bfloat16, False, ()),
    ]
    with pytest.raises(TypeError, match="cannot send"):
        _encode([torch.zeros(1, dtype=torch.complex64)])


def test_pipeline_config_block():
    assert PipelineConfig.from_dict(None).schedule == "1f1b"
    config = PipelineConfig.from_dict({"stages": 4, "schedule": "interleaved_1f1b"}, "pipeline")
    assert config.stages == 4 and config.to_dict()["schedule"] == "interleaved_1f1b"
    assert PipelineConfig.from_dict({"stages": "auto"}).stages == "auto"
    with pytest.raises(ConfigError, match=r"pipeline\.stages = 0"):
        PipelineConfig.from_dict({"stages": 0}, "pipeline")
    with pytest.raises(ConfigError, match=r"pipeline\.schedule"):
        PipelineConfig.from_dict({"schedule": "2bw"}, "pipeline")
    with pytest.raises(ConfigError, match=r"did you mean 'pipeline\.schedule'"):
        PipelineConfig.from_dict({"schedul": "1f1b"}, "pipeline")
