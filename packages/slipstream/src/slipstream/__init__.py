"""Slipstream: DeepSpeed-compatible training and serving of large models on PyTorch."""

from __future__ import annotations

# `slipstream` is shared by every Slipstream distribution. Only this umbrella ships an
# `__init__.py`; extending `__path__` keeps sibling packages (slipstream.kernels,
# slipstream.comm, ...) importable when they are installed into other site directories
# or as editable installs, where each lives under its own `src/` folder.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"

# The public names load lazily: `import slipstream.kernels` runs this file too, and must stay
# cheap for users who installed one package alone.
_LAZY = {
    "initialize": ("slipstream.entry", "initialize"),
    "add_config_arguments": ("slipstream.arguments", "add_config_arguments"),
    "init_distributed": ("slipstream.comm", "init_distributed"),
    "init_inference": ("slipstream.inference_entry", "init_inference"),
    "SlipstreamEngine": ("slipstream.runtime.engine", "SlipstreamEngine"),
    "load_config": ("slipstream.config", "load_config"),
    "get_fp32_state_dict_from_zero_checkpoint": (
        "slipstream.runtime.zero_checkpoint",
        "get_fp32_state_dict_from_zero_checkpoint",
    ),
}
# Sub-packages a DeepSpeed user reaches as attributes after `import slipstream`
# (`slipstream.zero.Init(...)`, `slipstream.checkpointing.checkpoint(...)`), imported on first use.
_SUBMODULES = frozenset(
    {
        "accelerator",
        "checkpointing",
        "comm",
        "data",
        "inference",
        "kernels",
        "moe",
        "ops",
        "pipe",
        "pipeline",
        "runtime",
        "utils",
        "zero",
    }
)

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"slipstream.{name}")
    raise AttributeError(f"module 'slipstream' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names and sub-packages are public although they are not loaded yet.
    dunders = [name for name in globals() if name.startswith("__")]
    return sorted({*dunders, *__all__, *_SUBMODULES})
