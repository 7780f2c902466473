"""Build the optimizer a DeepSpeed ``optimizer`` config block names, or take the client's own."""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from slipstream.kernels.config_schema import (
    ConfigError,
    NotImplementedFeatureError,
    config_fail,
    unknown_keys_error,
)
from slipstream.kernels.optim import FusedAdam, Lamb, Lion

logger = logging.getLogger(__name__)

__all__ = [
    "NOT_YET_IMPLEMENTED_OPTIMIZERS",
    "SUPPORTED_OPTIMIZERS",
    "build_optimizer",
    "check_constructor_params",
    "resolve_optimizer",
]

#: Names with DeepSpeed's own handling (matched case-insensitively).
SUPPORTED_OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "lamb", "lion", "adagrad", "sgd")

#: DeepSpeed optimizer names that Slipstream knows but does not provide yet, and why.
NOT_YET_IMPLEMENTED_OPTIMIZERS: dict[str, str] = {
    "onebitadam": "1-bit Adam (compressed-communication Adam)",
    "zerooneadam": "0/1 Adam (compressed-communication Adam)",
    "onebitlamb": "1-bit LAMB (compressed-communication LAMB)",
    "muadam": "MuAdam (from the mup package)",
    "muadamw": "MuAdamW (from the mup package)",
    "musgd": "MuSGD (from the mup package)",
    "muon": "DeepSpeed's Muon with auxiliary Adam (params tagged with use_muon)",
}

# Keys DeepSpeed reads from `optimizer.params` for Adam/AdamW on top of the optimizer's own
# arguments (FusedAdam's constructor plus the engine's torch_adam / adam_w_mode switches).
_ADAM_EXTRAS = ("torch_adam", "adam_w_mode", "bias_correction", "set_grad_none")
_LION_EXTRAS = ("set_grad_none",)

ParamsLike = Iterable[torch.Tensor] | Iterable[Mapping[str, Any]]


def _torch_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    found: dict[str, type[torch.optim.Optimizer]] = {}
    for name in dir(torch.optim):
        candidate = getattr(torch.optim, name)
        if (
            isinstance(candidate, type)
            and issubclass(candidate, torch.optim.Optimizer)
            and candidate is not torch.optim.Optimizer
        ):
            found[name.lower()] = candidate
    return found


def build_optimizer(
    optimizer_config: Any, model_parameters: ParamsLike, *, config: Any = None
) -> torch.optim.Optimizer:
    """Create the optimizer named by a DeepSpeed ``optimizer`` block.

    ``optimizer_config`` has ``.type`` (the name, case-insensitive) and ``.params`` (keyword
    arguments). Names, as in DeepSpeed:

    - ``adam``: decoupled weight decay (AdamW) unless ``params.adam_w_mode`` is false, then
      L2-style Adam; ``adamw``: always decoupled. ``torch_adam`` is accepted; both map to
      ``torch.optim.Adam``/``AdamW``, using the fused CUDA implementation when every parameter
      is on a CUDA/ROCm device and ``torch_adam`` is not set (the analogue of FusedAdam).
    - ``lamb``: :class:`slipstream.kernels.optim.Lamb` (DeepSpeed FusedLamb semantics).
    - ``lion``: :class:`slipstream.kernels.optim.Lion` (DeepSpeed FusedLion semantics).
    - ``adagrad``, ``sgd``: ``torch.optim.Adagrad`` / ``torch.optim.SGD``.
    - any other ``torch.optim`` class by name, case-insensitive (``RMSprop``, ``NAdam``, ...).

    ``model_parameters`` is an iterable of tensors or of parameter-group dicts. ``config`` is
    the whole Slipstream config; it is accepted so the engine can hand it over, and is not
    read today.

    Raises:
        NotImplementedFeatureError: a DeepSpeed optimizer Slipstream does not provide yet.
        ConfigError: an unknown name, an unknown or invalid parameter (the message names
            ``optimizer.params.<key>`` and suggests the closest valid key).

    >>> from types import SimpleNamespace
    >>> block = SimpleNamespace(type="AdamW", params={"lr": 1e-4, "betas": [0.9, 0.95]})
    >>> opt = build_optimizer(block, [torch.nn.Parameter(torch.zeros(2))])
    >>> type(opt).__name__, opt.defaults["betas"]
    ('AdamW', (0.9, 0.95))
    """
    del config  # reserved: see the docstring
    name = str(optimizer_config.type)
    key = name.strip().lower()
    params = dict(optimizer_config.params or {})
    param_list = _as_param_list(model_parameters)

    if "max_grad_norm" in params:
        raise ConfigError(
            f"optimizer.params.max_grad_norm={params['max_grad_norm']!r} is not an optimizer "
            "parameter in DeepSpeed configs; set the top-level 'gradient_clipping' instead",
            "optimizer.params.max_grad_norm",
        )
    if key in NOT_YET_IMPLEMENTED_OPTIMIZERS:
        raise NotImplementedFeatureError(
            f"optimizer.type={name!r} ({NOT_YET_IMPLEMENTED_OPTIMIZERS[key]}) is a DeepSpeed "
            "optimizer that Slipstream does not implement yet. Use one of "
            f"{', '.join(SUPPORTED_OPTIMIZERS)}, or build the optimizer yourself and pass it as "
            "initialize(optimizer=...)",
            "optimizer.type",
        )

    if key in ("adam", "adamw"):
        cls, kwargs = _adam_arguments(key, params, param_list)
    elif key == "lamb":
        cls, kwargs = Lamb, check_constructor_params(Lamb, params, path="optimizer.params")
    elif key == "lion":
        kwargs = check_constructor_params(
            Lion, params, path="optimizer.params", extras=_LION_EXTRAS
        )
        _consume_set_grad_none(kwargs)
        cls = Lion
    else:
        torch_classes = _torch_optimizers()
        if key not in torch_classes:
            valid = sorted(
                (set(SUPPORTED_OPTIMIZERS) | set(torch_classes))
                - set(NOT_YET_IMPLEMENTED_OPTIMIZERS)
            )
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"optimizer.type={name!r} is not a known optimizer.{hint} Valid names "
                f"(case-insensitive): {', '.join(valid)}",
                "optimizer.type",
            )
        cls = torch_classes[key]
        kwargs = check_constructor_params(cls, params, path="optimizer.params")

    logger.debug("building optimizer %s(%s) for optimizer.type=%r", cls.__name__, kwargs, name)
    try:
        return cls(param_list, **kwargs)
    except (TypeError, ValueError) as error:
        raise ConfigError(
            f"optimizer.type={name!r}: {cls.__name__} rejected "
            f"optimizer.params={kwargs!r}: {error}",
            "optimizer.params",
        ) from error


def resolve_optimizer(
    client_optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer] | None,
    optimizer_config: Any,
    model_parameters: ParamsLike,
    *,
    config: Any = None,
) -> torch.optim.Optimizer | None:
    """Pick the optimizer the way ``deepspeed.initialize`` does.

    ``client_optimizer`` is an optimizer instance (used as is), or a callable that takes
    ``model_parameters`` and returns one. Otherwise the ``optimizer`` config block is built
    with :func:`build_optimizer`. With neither, returns ``None`` (no training step).

    When both a client optimizer and an ``optimizer`` block are given, the client's is used
    and the block is ignored, as ``deepspeed.initialize`` does; a warning names both.

    Raises:
        TypeError: the client optimizer is neither an optimizer nor a callable returning one.
    """
    if client_optimizer is not None and optimizer_config is not None:
        logger.warning(
            "initialize(optimizer=%s) was given and the config also has an 'optimizer' block "
            "(type %r): using the client optimizer and ignoring the config block, as DeepSpeed "
            "does; remove one of them to silence this warning",
            type(client_optimizer).__name__,
            getattr(optimizer_config, "type", "?"),
        )
    if client_optimizer is None:
        if optimizer_config is None:
            return None
        return build_optimizer(optimizer_config, model_parameters, config=config)
    if isinstance(client_optimizer, torch.optim.Optimizer):
        logger.debug("using the client optimizer %s", type(client_optimizer).__name__)
        return client_optimizer
    if callable(client_optimizer):
        built = client_optimizer(_as_param_list(model_parameters))
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer callable passed to initialize() returned {type(built).__name__}, "
                "not a torch.optim.Optimizer; return an optimizer built from the parameters it "
                "is given"
            )
        return built
    raise TypeError(
        f"initialize(optimizer=...) got {type(client_optimizer).__name__}; pass a "
        "torch.optim.Optimizer, a callable(params) -> Optimizer, or None to use the config's "
        "'optimizer' block"
    )


def _adam_arguments(
    key: str, params: dict[str, Any], param_list: list[Any]
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    for flag in _ADAM_EXTRAS:
        if flag in params and not isinstance(params[flag], bool):
            config_fail(f"optimizer.params.{flag}", params[flag], "true or false")
    torch_adam = params.get("torch_adam", False)
    adam_w_mode = params.get("adam_w_mode", True)
    # DeepSpeed: the name "adamw" forces decoupled decay; "adam" follows adam_w_mode (default true).
    cls: type[torch.optim.Optimizer] = (
        torch.optim.AdamW if key == "adamw" or adam_w_mode else torch.optim.Adam
    )
    kwargs = check_constructor_params(cls, params, path="optimizer.params", extras=_ADAM_EXTRAS)
    kwargs.pop("torch_adam", None)
    kwargs.pop("adam_w_mode", None)
    if not kwargs.pop("bias_correction", True):
        # torch's Adam/AdamW always correct the moments' bias; FusedAdam (the adam op: C++ on
        # CPU, Triton/CUDA on GPUs) has DeepSpeed's switch.
        _consume_set_grad_none(kwargs)
        return FusedAdam, _fused_adam_arguments(kwargs, decoupled=cls is torch.optim.AdamW)
    _consume_set_grad_none(kwargs)
    if (
        not torch_adam
        and "fused" not in kwargs
        and "foreach" not in kwargs
        and _all_on_cuda(param_list)
    ):
        # The single-kernel CUDA implementation; DeepSpeed uses its FusedAdam here.
        kwargs["fused"] = not kwargs.get("differentiable", False)
    return cls, kwargs


def _fused_adam_arguments(kwargs: dict[str, Any], *, decoupled: bool) -> dict[str, Any]:
    """FusedAdam's arguments for ``bias_correction: false``, or a clear error for the rest."""
    unsupported = sorted(
        key
        for key, value in kwargs.items()
        if key not in ("lr", "betas", "eps", "weight_decay") and value not in (False, None)
    )
    if unsupported:
        raise NotImplementedFeatureError(
            "optimizer.params.bias_correction=false is implemented by Slipstream's FusedAdam, "
            f"which does not take {', '.join('optimizer.params.' + k for k in unsupported)}; "
            "remove those keys or keep bias correction on",
            "optimizer.params.bias_correction",
        )
    chosen = {k: v for k, v in kwargs.items() if k in ("lr", "betas", "eps", "weight_decay")}
    if "betas" in chosen:
        chosen["betas"] = tuple(chosen["betas"])
    return {**chosen, "bias_correction": False, "adam_w_mode": decoupled}


def _consume_set_grad_none(kwargs: dict[str, Any]) -> None:
    if kwargs.pop("set_grad_none", True) is False:
        logger.warning(
            "optimizer.params.set_grad_none=false has no effect: Slipstream always frees "
            "gradients (sets them to None) when they are zeroed"
        )


def check_constructor_params(
    cls: type, params: Mapping[str, Any], *, path: str, extras: Iterable[str] = ()
) -> dict[str, Any]:
    """Check config ``params`` against the keyword arguments of ``cls``'s constructor.

    The first constructor argument (the parameters, or the optimizer) is not a config key. ``extras`` are further keys the caller consumes itself. Returns a copy of
    ``params`` with a ``betas`` list turned into a tuple.

    Raises:
        ConfigError: a key that ``cls`` does not take (naming ``<path>.<key>`` and the closest
            valid key), or a required argument that is missing.
    """
    signature = inspect.signature(cls)
    accepted: list[str] = []
    required: list[str] = []
    takes_any = False
    for index, (pname, parameter) in enumerate(signature.parameters.items()):
        if index == 0:  # the parameters (optimizer) or the optimizer (schedule)
            continue
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            takes_any = True
        elif parameter.kind is not inspect.Parameter.VAR_POSITIONAL:
            accepted.append(pname)
            if parameter.default is inspect.Parameter.empty:
                required.append(pname)
    accepted.extend(extras)
    if not takes_any:
        unknown = [pkey for pkey in params if pkey not in accepted]
        if unknown:
            raise unknown_keys_error(path, unknown, accepted)
    for pname in required:
        if pname not in params:
            raise ConfigError(
                f"{path}.{pname} is required by {cls.__name__}; add it", f"{path}.{pname}"
            )
    kwargs = dict(params)
    if path.startswith("optimizer"):
        _check_hyperparameter_values(kwargs, path)
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    return kwargs


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_hyperparameter_values(params: Mapping[str, Any], path: str) -> None:
    """The hyper-parameters every optimizer reads the same way: checked here, so that a wrong
    value is a ConfigError naming the key instead of an IndexError inside the first step."""
    betas = params.get("betas")
    if "betas" in params and not (
        isinstance(betas, (list, tuple))
        and len(betas) == 2
        and all(_is_number(b) and 0.0 <= b < 1.0 for b in betas)
    ):
        config_fail(f"{path}.betas", betas, "a list of two numbers in [0, 1), e.g. [0.9, 0.999]")
    for key in ("lr", "eps", "weight_decay"):
        if key in params and not (_is_number(params[key]) and params[key] >= 0):
            config_fail(f"{path}.{key}", params[key], "a number >= 0")


def _as_param_list(model_parameters: ParamsLike) -> list[Any]:
    if isinstance(model_parameters, torch.Tensor):
        items: list[Any] = [model_parameters]
    else:
        items = list(model_parameters)
    if not items:
        raise ValueError(
            "model_parameters is empty: the optimizer has nothing to train. Pass "
            "model.parameters() (with at least one parameter that requires grad) or param groups"
        )
    normalized: list[Any] = []
    for item in items:
        if isinstance(item, Mapping):
            if "params" not in item:
                raise ValueError(
                    f"a parameter group has no 'params' key (keys: {sorted(item)}); each group "
                    "must be a dict like {'params': [...], 'lr': ...}"
                )
            group = dict(item)
            group_params = group["params"]
            # Materialise generators: the list is read twice (device check, optimizer).
            group["params"] = (
                [group_params] if isinstance(group_params, torch.Tensor) else list(group_params)
            )
            if isinstance(group.get("betas"), list):
                group["betas"] = tuple(group["betas"])
            normalized.append(group)
        else:
            normalized.append(item)
    return normalized


def _all_on_cuda(param_list: list[Any]) -> bool:
    tensors: list[Any] = []
    for item in param_list:
        if isinstance(item, Mapping):
            tensors.extend(item["params"])
        else:
            tensors.append(item)
    return bool(tensors) and all(
        isinstance(t, torch.Tensor) and t.device.type == "cuda" and torch.is_floating_point(t)
        for t in tensors
    )
