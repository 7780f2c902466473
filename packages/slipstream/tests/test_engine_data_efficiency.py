"""The engine with slipstream.data: seqlen curriculum as configured, and curriculum + sampler +
random-LTD runs that checkpoint and resume exactly like an uninterrupted run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from slipstream.comm.testing import run_distributed

SEQ, VOCAB, N = 16, 32, 64


class Block(nn.Module):
    """A causal token mixer (running mean) and an MLP, with a residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(1, hidden.shape[1] + 1, device=hidden.device).view(1, -1, 1)
        mixed = hidden.cumsum(dim=1) / steps
        return hidden + self.mlp(self.mix(mixed))


class TinyLM(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(width, VOCAB)
        self.seen: list[int] = []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.seen.append(input_ids.shape[1])
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        return F.cross_entropy(self.head(hidden).flatten(0, 1), labels.flatten())


class SeqlenAwareLM(TinyLM):
    """A model that takes curriculum_seqlen (DeepSpeed's contract): it cuts its own inputs."""

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, labels: torch.Tensor, curriculum_seqlen: int | None = None
    ) -> torch.Tensor:
        self.received = curriculum_seqlen
        if curriculum_seqlen is not None:
            input_ids, labels = input_ids[:, :curriculum_seqlen], labels[:, :curriculum_seqlen]
        return super().forward(input_ids, labels)


class Tokens(Dataset):
    """Sample i: a deterministic sequence; its 'difficulty' metric is i % 8 + 1."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        ids = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
        return {"input_ids": ids[:-1], "labels": ids[1:]}


LEGACY = {
    "enabled": True,
    "curriculum_type": "seqlen",
    "min_difficulty": 4,
    "max_difficulty": SEQ,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 4},
}


def _expected_seqlen(step: int) -> int:
    value = math.floor(step / 6 * (SEQ - 4) + 4)
    return min(value - value % 4, SEQ)


def _config(index_prefix: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "curriculum_learning": LEGACY,
        "data_efficiency": {
            "enabled": True,
            "seed": 5,
            "data_sampling": {
                "enabled": True,
                "curriculum_learning": {
                    "enabled": True,
                    "data_cluster_path": "/tmp/unused",
                    "curriculum_metrics": {
                        "level": {
                            "index_to_sample_path": f"{index_prefix}_index_to_sample",
                            "index_to_metric_path": f"{index_prefix}_index_to_metric",
                            "difficulty_type": "value",
                            "clustering_type": "schedule_based",
                            "min_difficulty": 4,
                            "max_difficulty": 8,
                            "schedule_type": "fixed_discrete",
                            "schedule_config": {"difficulty": [4, 6, 8], "max_step": [2, 4]},
                        }
                    },
                },
            },
            "data_routing": {
                "enabled": True,
                "random_ltd": {
                    "enabled": True,
                    "total_layer_num": 3,
                    "random_ltd_layer_num": 2,
                    "random_ltd_layer_id": [1, 2],
                    "model_mask_name": None,
                    "model_type": "decoder",
                    "hidden_state_order": "batch_seq_dim",
                    "random_ltd_schedule": {
                        "min_value": 4,
                        "max_value": SEQ,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"require_steps": 8, "seq_per_step": 2},
                    },
                    "layer_token_lr_schedule": {
                        "enabled": True,
                        "total_layer_tokens": 4000,
                        "warmup_layer_tokens": 200,
                    },
                },
            },
        },
    }


def _train(engine: Any, iterator: Any, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        for _ in range(engine.gradient_accumulation_steps()):
            batch = next(iterator)
            loss = engine(batch["input_ids"], batch["labels"])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    return losses


def _engine(index_prefix: str, seed: int) -> tuple[Any, Any]:
    import slipstream
    from slipstream.data import convert_to_random_ltd

    torch.manual_seed(seed)
    model = TinyLM()
    convert_to_random_ltd(model, Block)
    engine, _, loader, _ = slipstream.initialize(
        model=model, config=_config(index_prefix), training_data=Tokens()
    )
    return engine, loader


def _worker(save_dir: str, index_prefix: str) -> dict[str, Any]:
    import slipstream
    from slipstream import comm
    from slipstream.data import CurriculumSampler, RandomLayerTokenDrop, convert_to_random_ltd

    rank = comm.get_rank()
    out: dict[str, Any] = {}

    # 1. Uninterrupted reference, with a checkpoint after 3 of 6 steps (mid-epoch).
    engine, loader = _engine(index_prefix, seed=0)
    assert isinstance(loader.batch_sampler, CurriculumSampler)
    wrapped = [m for m in engine.module.modules() if isinstance(m, RandomLayerTokenDrop)]
    out["attached"] = [m.scheduler is not None for m in wrapped]
    iterator = iter(loader)
    steps_seen: list[int] = []
    engine.set_data_post_process_func(
        lambda batch, progress: steps_seen.append(progress["curriculum_step"]) or batch
    )
    first = _train(engine, iterator, 3)
    out["post_process_steps"] = list(steps_seen)
    engine.save_checkpoint(save_dir, client_state={"mine": 1})
    out["uninterrupted"] = _train(engine, iterator, 3)
    out["seen"] = engine.module.seen
    out["lr"] = engine.get_lr()
    final = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    ltd = engine.data_efficiency.random_ltd
    out["ltd_tokens"] = ltd.state["consumed_layer_tokens"]
    # The last step kept 10 of 16 tokens in layers 1 and 2 (indices drawn by that forward).
    out["dropped"] = None if ltd.sample_indices is None else tuple(ltd.sample_indices.shape)

    # 2. A fresh engine (other init, other RNG), resumed from the checkpoint.
    engine2, loader2 = _engine(index_prefix, seed=99)
    iterator2 = iter(loader2)  # before loading: DataLoader's iterator draws from the RNG
    _, client_state = engine2.load_checkpoint(save_dir)
    out["client_state"] = client_state
    out["resumed"] = _train(engine2, iterator2, 3)
    out["identical"] = all(
        torch.equal(final[n], p.detach()) for n, p in engine2.module.named_parameters()
    )
    out["lr2"] = engine2.get_lr()
    out["first"] = first

    # 3. The seqlen curriculum reaches a model that takes curriculum_seqlen as a keyword.
    plain = {k: v for k, v in _config(index_prefix).items() if k != "data_efficiency"}
    torch.manual_seed(0)
    aware = SeqlenAwareLM()
    engine3, *_ = slipstream.initialize(model=aware, config=plain)
    received = []
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    for _ in range(6 * 2):
        loss = engine3(ids[:, :-1], ids[:, 1:])
        received.append(aware.received)
        engine3.backward(loss)
        engine3.step()
    out["received"] = received
    out["aware_seen"] = aware.seen

    # 4. set_curriculum_learning_params, as the seeds' guide writes it.
    torch.manual_seed(0)
    model4 = TinyLM()
    base = {k: v for k, v in plain.items() if k != "curriculum_learning"}
    engine4, *_ = slipstream.initialize(model=model4, config=base)
    engine4.set_curriculum_learning_params(
        curriculum_type="seqlen",
        min_difficulty=8,
        max_difficulty=SEQ,
        schedule_type="linear",
        schedule_config={"total_curriculum_step": 2, "difficulty_step": 8},
    )
    for _ in range(3 * 2):
        engine4.backward(engine4(ids[:, :-1], ids[:, 1:]))
        engine4.step()
    out["programmatic_seen"] = model4.seen

    # 5. DeepSpeed's order: convert_to_random_ltd(engine, Block) after initialize attaches.
    torch.manual_seed(0)
    engine5, *_ = slipstream.initialize(model=TinyLM(), config=_config(index_prefix))
    convert_to_random_ltd(engine5, Block)
    out["late_attached"] = [
        m.scheduler is engine5.data_efficiency.random_ltd
        for m in engine5.module.modules()
        if isinstance(m, RandomLayerTokenDrop)
    ]
    engine5.destroy()
    engine.destroy(), engine2.destroy(), engine3.destroy(), engine4.destroy()
    return out


def test_curriculum_sampler_and_random_ltd_resume_exactly(tmp_path: Path) -> None:
    from slipstream.data import write_rows

    # The 'level' metric's index files, as DataAnalyzer writes them: rows by value.
    levels = torch.arange(N) % 8 + 1
    prefix = str(tmp_path / "level" / "level")
    values = sorted(set(levels.tolist()))
    write_rows(
        f"{prefix}_index_to_sample",
        [torch.nonzero(levels == v).flatten().numpy() for v in values],
        "int64",
    )
    write_rows(f"{prefix}_index_to_metric", [[v] for v in values], "int64")

    results = run_distributed(_worker, 2, str(tmp_path / "ckpt"), prefix)
    for rank, out in enumerate(results):
        assert out["attached"] == [False, True, True]  # layer ids 1 and 2 of blocks 0..2
        assert out["resumed"] == out["uninterrupted"], rank  # exact float equality
        assert out["identical"], rank
        assert out["dropped"] == (2, 2, 10)  # (random-LTD layers, micro-batch, kept tokens)
        assert out["lr"] == out["lr2"] and out["lr"][0] < 0.01  # the layer-token LR moved
        assert out["client_state"] == {"mine": 1}  # the engine's own entry is taken out
        # Legacy seqlen curriculum: the model without curriculum_seqlen gets truncated
        # batches, difficulty at step s (1-based) for both micro-batches of the step.
        expected = [_expected_seqlen(step) for step in range(1, 7) for _ in range(2)]
        assert out["seen"] == expected, out["seen"]
        assert out["received"] == expected
        assert out["aware_seen"] == expected  # it cut its own inputs: nothing cut for it
        assert out["programmatic_seen"] == [8, 8, 16, 16, 16, 16]
        assert out["late_attached"] == [False, True, True]
        assert out["post_process_steps"] == [1, 1, 2, 2, 3, 3]  # two micro-batches a step
    assert results[0]["uninterrupted"] != results[1]["uninterrupted"]  # ranks got own data


# DeepSpeedExamples training/data_efficiency/vit_finetuning/config/ds_config_cifar_random_ltd.json,
# whole and unchanged.
VIT_CIFAR_RANDOM_LTD = """{
  "train_batch_size" : 32,
  "train_micro_batch_size_per_gpu": 32,
  "steps_per_print": 200,
  "optimizer": {"type": "Adam",
    "params": {"lr": 0.0001, "betas": [0.8,0.999], "eps": 1e-8, "weight_decay": 3e-7}},
  "zero_optimization": {"stage": 0},
  "fp16":{"enabled": false},
  "gradient_clipping": 1.0,
  "prescale_gradients": true,
  "wall_clock_breakdown" : false,
  "data_efficiency": {
    "enabled": true,
    "data_routing": {
      "enabled": true,
      "random_ltd":{
        "enabled": true,
        "total_layer_num": 12,
        "random_ltd_layer_num": 10,
        "random_ltd_layer_id": [1,2,3,4,5,6,7,8,9,10],
        "model_mask_name": null,
        "model_type": "decoder",
        "hidden_state_order": "batch_seq_dim",
        "random_ltd_schedule": {
          "min_value": 32,
          "max_value": 197,
          "schedule_type":"fixed_linear",
          "schedule_config": {"require_steps": 3910, "seq_per_step": 8}
        }
      }
    }
  }
}
"""


def test_deepspeed_example_config_loads_unchanged(tmp_path: Path) -> None:
    from slipstream.config import ConfigError, load_config

    path = tmp_path / "ds_config_cifar_random_ltd.json"
    path.write_text(VIT_CIFAR_RANDOM_LTD)
    config = load_config(path, world_size=1)
    ltd = config.data_efficiency.data_routing.random_ltd
    assert config.data_efficiency.random_ltd_enabled and ltd.random_ltd_layer_num == 10
    assert not config.curriculum_learning.enabled
    legacy = {
        "train_batch_size": 4,
        "curriculum_learning": dict(LEGACY, schedule_type="fixed_root"),
    }
    try:
        load_config(legacy, world_size=1)
    except ConfigError as error:
        assert "curriculum_learning.schedule_config.root_degree" in str(error)
    else:
        raise AssertionError("fixed_root without root_degree was accepted")


class LayerDropLM(TinyLM):
    """A model taking DeepSpeed's PLD keywords; it skips blocks with run_layers_with_drop."""

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        progressive_layer_drop: bool = False,
        pld_theta: float | None = None,
    ) -> torch.Tensor:
        from slipstream.data import run_layers_with_drop

        self.thetas.append(pld_theta if progressive_layer_drop else None)
        hidden = run_layers_with_drop(
            list(self.blocks), self.embed(input_ids), pld_theta=pld_theta, training=self.training
        )
        return F.cross_entropy(self.head(hidden).flatten(0, 1), labels.flatten())


def test_progressive_layer_drop_theta_reaches_the_model_and_resumes(tmp_path: Path) -> None:
    import slipstream

    theta, gamma = 0.3, 0.2
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "progressive_layer_drop": {"enabled": True, "theta": theta, "gamma": gamma},
    }

    def build() -> Any:
        model = LayerDropLM()
        model.thetas = []
        return slipstream.initialize(model=model, config=config)[0]

    def expected(global_step: int) -> float:
        # DeepSpeed: theta(0) = 1 until the first step; step g's forward sees theta(g - 1).
        return (
            1.0 if global_step == 0 else (1 - theta) * math.exp(-gamma * (global_step - 1)) + theta
        )

    torch.manual_seed(0)
    engine = build()
    batch = Tokens()[0]
    ids, labels = batch["input_ids"].repeat(2, 1), batch["labels"].repeat(2, 1)
    for _ in range(4 * 2):
        engine.backward(engine(ids, labels))
        engine.step()
    assert engine.module.thetas == [expected(g) for g in range(4) for _ in range(2)]
    engine.save_checkpoint(str(tmp_path))
    resumed = build()
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.progressive_layer_drop.get_theta() == engine.progressive_layer_drop.get_theta()
    resumed(ids, labels)
    assert resumed.module.thetas == [expected(4)]
