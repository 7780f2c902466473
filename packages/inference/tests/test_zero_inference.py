"""ZeRO-Inference: weights streamed from host memory layer by layer equal the resident model."""

from __future__ import annotations

import pytest
import torch

from slipstream.inference import init_inference
from slipstream.inference.testing import tiny_hf_model
from slipstream.inference.zero_inference import LayerStreamer
from slipstream.kernels.config_schema import NotImplementedFeatureError

pytest.importorskip("transformers")


@pytest.mark.parametrize("weights", ["fp32", "int8", "int4-head8"])
def test_streamed_equals_resident(weights: str) -> None:
    model = tiny_hf_model("llama", layers=3)
    weight: dict = {"group_size": 32, "compute_dtype": "fp32"}
    if weights == "int4-head8":  # int4 blocks streamed, the resident head int8 (lm_head_bits)
        weight.update(num_bits=4, lm_head=True, lm_head_bits=8)
    config = {
        "dtype": "int8" if weights == "int4-head8" else weights,
        "replace_with_kernel_inject": True,
        "max_out_tokens": 32,
        "quant": {"weight": weight},
    }
    resident = init_inference(model, config)
    offload = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}
    streamed = init_inference(model, config, zero=offload)
    assert streamed.fused is not None
    streamer = streamed.fused.layer_hook
    assert isinstance(streamer, LayerStreamer)
    ids = torch.randint(3, 96, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    assert torch.equal(
        streamed(ids, attention_mask=mask).logits, resident(ids, attention_mask=mask).logits
    )
    # Between layers the blocks hold their host copies; each forward copied every block once.
    block_weight = streamed.fused.blocks[1].input_norm.weight
    assert block_weight.data_ptr() == streamer.host[1][0].data_ptr()
    assert streamer.fetches >= 3
    # Double-buffered; only block 0, prefetched for the next pass, still holds a ring set.
    assert len(streamer.ring) == 2 and set(streamer.in_ring) == set(streamer.ready) == {0}
    kwargs = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    assert torch.equal(
        streamed.generate(ids, attention_mask=mask, **kwargs),
        resident.generate(ids, attention_mask=mask, **kwargs),
    )


def test_offload_with_cuda_graphs_is_refused() -> None:
    with pytest.raises(NotImplementedFeatureError, match="enable_cuda_graph"):
        init_inference(
            tiny_hf_model("llama", layers=1),
            replace_with_kernel_inject=True,
            enable_cuda_graph=True,
            zero={"stage": 3, "offload_param": {"device": "cpu"}},
        )


def test_nvme_streamed_equals_resident(tmp_path) -> None:
    pytest.importorskip("slipstream.offload")
    model = tiny_hf_model("llama", layers=3)
    config = {"dtype": "fp32", "replace_with_kernel_inject": True, "max_out_tokens": 32}
    resident = init_inference(model, config)
    offload = {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0},
    }
    streamed = init_inference(model, config, zero=offload)
    assert streamed.fused is not None
    streamer = streamed.fused.layer_hook
    assert isinstance(streamer, LayerStreamer) and streamer.store is not None
    assert list(tmp_path.iterdir())  # the swap folder
    ids = torch.randint(3, 96, (2, 7))
    kwargs = {"max_new_tokens": 5, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    assert torch.equal(streamed(ids).logits, resident(ids).logits)
    assert torch.equal(streamed.generate(ids, **kwargs), resident.generate(ids, **kwargs))
    # Between forwards: block 0 waits on the device for the next one, block 1 is read ahead
    # from disk, block 2 is on disk only.
    assert 0 in streamer.ready
    assert not streamer.store.is_swapped(streamer.host[1][0])
    assert all(streamer.store.is_swapped(t) for t in streamer.host[2])
    with pytest.raises(Exception, match="nvme_path"):
        init_inference(model, config, zero={"stage": 3, "offload_param": {"device": "nvme"}})
