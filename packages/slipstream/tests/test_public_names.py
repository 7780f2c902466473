"""The names a DeepSpeed user reaches from `import slipstream` alone."""

from __future__ import annotations

import pytest


def test_deepspeed_style_names_resolve_after_import_slipstream() -> None:
    import slipstream

    assert callable(slipstream.initialize)
    assert callable(slipstream.add_config_arguments)
    assert callable(slipstream.get_fp32_state_dict_from_zero_checkpoint)
    assert slipstream.zero.Init.__name__ == "Init"
    assert slipstream.zero.GatheredParameters.__name__ == "GatheredParameters"
    assert callable(slipstream.checkpointing.checkpoint)
    assert slipstream.pipe.PipelineModule.__name__ == "PipelineModule"
    assert slipstream.moe.MoE.__name__ == "MoE"
    # The umbrella wraps the inference package's entry point (training checkpoints too).
    assert slipstream.init_inference.__module__ == "slipstream.inference_entry"
    with pytest.raises(AttributeError, match="no attribute 'zer0'"):
        _ = slipstream.zer0
