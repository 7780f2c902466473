"""NVMe parameter offload is refused for a model on a GPU (verified on CPU only so far)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slipstream.zero.stage3.model import _refuse_nvme_params_on_gpu


def test_nvme_parameter_offload_is_refused_off_the_cpu() -> None:
    on_meta = SimpleNamespace(param=torch.empty(4, device="meta"))
    with pytest.raises(NotImplementedError, match=r"offload_param.device='nvme'.*meta"):
        _refuse_nvme_params_on_gpu(on_meta, None)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match='"device": "cpu"'):
        _refuse_nvme_params_on_gpu(on_meta, torch.device("cuda", 0))  # type: ignore[arg-type]
    on_cpu = SimpleNamespace(param=torch.empty(4))
    _refuse_nvme_params_on_gpu(on_cpu, None)  # type: ignore[arg-type]
    _refuse_nvme_params_on_gpu(on_meta, torch.device("cpu"))  # type: ignore[arg-type]
