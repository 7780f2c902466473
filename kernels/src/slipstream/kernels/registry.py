"""The op registry: each op has several backends; pick the best available per device and dtype."""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

OP_BACKEND_ENV = "SLIPSTREAM_OP_BACKEND"
BUILTIN_OPS_MODULE = "slipstream.kernels.ops"
ANY_DEVICE = "*"  # in device_types: runs on every torch device type (pure-torch references)

Probe = Callable[[], tuple[bool, str]]


class UnknownOpError(KeyError):
    """An op name (or an op's backend name) that nothing registered."""

    def __str__(self) -> str:
        # KeyError would print the message inside quotes.
        return str(self.args[0]) if self.args else ""


class OpUnavailableError(RuntimeError):
    """No backend of an op can run on the device/dtype asked for, or a forced one cannot."""


@dataclass
class _Backend:
    op: str
    backend: str
    target: Callable[..., Any] | str
    device_types: frozenset[str]
    dtypes: frozenset[torch.dtype] | None
    priority: int
    probe: Probe | None
    order: int
    status: tuple[bool, str] | None = None
    loaded: Callable[..., Any] | None = None

    def supports(self, device_type: str, dtype: torch.dtype | None) -> bool:
        if ANY_DEVICE not in self.device_types and device_type not in self.device_types:
            return False
        if self.dtypes is None:
            return True
        # A dtype-restricted backend is only chosen when the caller says which dtype it has.
        return dtype is not None and dtype in self.dtypes


@dataclass(frozen=True)
class OpRow:
    """One backend of one op as :func:`list_ops` reports it."""

    op: str
    backend: str
    device_types: tuple[str, ...]
    dtypes: tuple[str, ...] | None
    priority: int
    available: bool
    reason: str
    selected: bool


class OpRegistry:
    """Holds every op's backends and chooses among them.

    Most code uses the module-level :func:`register_op`, :func:`get_op` and :func:`list_ops`,
    which act on the process-wide registry; tests build their own ``OpRegistry()``.

    Choosing (see docs/kernels.md): among the backends that support the device type (and the
    dtype, when the backend restricts dtypes), the highest priority that is available wins;
    ties go to the earlier registration. Each higher-priority backend skipped because it is
    unavailable is logged once per (op, backend, device type). ``SLIPSTREAM_OP_BACKEND``
    forces a backend per op.
    """

    def __init__(self, builtin_module: str | None = None) -> None:
        """``builtin_module`` is imported on first query; importing it registers built-in ops."""
        self.builtin_module = builtin_module
        self._backends: dict[str, dict[str, _Backend]] = {}
        self._selection: dict[tuple[Any, ...], tuple[str, Callable[..., Any]]] = {}
        self._warned: set[tuple[str, str, str]] = set()
        self._lock = threading.RLock()
        self._counter = 0
        self._builtins_loaded = False

    # -- registration ----------------------------------------------------------------------
    def register(
        self,
        op: str,
        backend: str,
        fn: Callable[..., Any] | str,
        *,
        device_types: Iterable[str],
        dtypes: Iterable[torch.dtype] | None = None,
        priority: int = 0,
        available: Probe | None = None,
        replace: bool = False,
    ) -> None:
        """Add backend ``backend`` of ``op``; see :func:`register_op`."""
        if isinstance(fn, str):
            if fn.count(":") != 1 or not all(fn.split(":")):
                raise ValueError(
                    f"lazy loader {fn!r} for op {op!r} backend {backend!r} must look like "
                    "'package.module:attribute'"
                )
        elif not callable(fn):
            raise TypeError(f"op {op!r} backend {backend!r}: fn must be callable or 'module:attr'")
        devices = frozenset(device_types) if not isinstance(device_types, str) else {device_types}
        if not devices:
            raise ValueError(f"op {op!r} backend {backend!r}: device_types must not be empty")
        with self._lock:
            backends = self._backends.setdefault(op, {})
            if backend in backends and not replace:
                raise ValueError(
                    f"op {op!r} already has a backend {backend!r}; pass replace=True to replace it"
                )
            self._counter += 1
            backends[backend] = _Backend(
                op=op,
                backend=backend,
                target=fn,
                device_types=frozenset(devices),
                dtypes=None if dtypes is None else frozenset(dtypes),
                priority=priority,
                probe=available,
                order=self._counter,
            )
            self._selection.clear()

    def _ensure_builtins(self) -> None:
        if self.builtin_module is None or self._builtins_loaded:
            return
        # Set first: importing the module registers into this very registry.
        self._builtins_loaded = True
        try:
            importlib.import_module(self.builtin_module)
        except BaseException:
            self._builtins_loaded = False  # let the next query retry and raise again
            raise

    # -- queries ---------------------------------------------------------------------------
    def ops(self) -> list[str]:
        """Names of every registered op, sorted."""
        with self._lock:
            self._ensure_builtins()
            return sorted(self._backends)

    def backends(self, op: str) -> list[str]:
        """Names of ``op``'s backends, highest priority first."""
        with self._lock:
            return [b.backend for b in self._ranked(self._op_backends(op))]

    def availability(self, op: str, backend: str) -> tuple[bool, str]:
        """``(available, reason)`` for one backend; probes and loads it on first call."""
        with self._lock:
            entry = self._op_backends(op).get(backend)
            if entry is None:
                raise UnknownOpError(
                    f"op {op!r} has no backend {backend!r}; its backends are "
                    f"{', '.join(sorted(self._op_backends(op)))}"
                )
            return self._status(entry)

    def get(
        self, op: str, device_type: str | torch.device, dtype: torch.dtype | None = None
    ) -> Callable[..., Any]:
        """The callable to use for ``op`` on ``device_type`` (and ``dtype``); see :func:`get_op`."""
        return self.select(op, device_type, dtype)[1]

    def select(
        self, op: str, device_type: str | torch.device, dtype: torch.dtype | None = None
    ) -> tuple[str, Callable[..., Any]]:
        """Like :meth:`get`, but also return the chosen backend's name."""
        device = device_type.type if isinstance(device_type, torch.device) else device_type
        forced = forced_backends().get(op)
        key = (op, device, dtype, forced)
        cached = self._selection.get(key)
        if cached is not None:
            return cached
        with self._lock:
            backends = self._op_backends(op)
            if forced is not None:
                chosen = self._select_forced(op, forced, backends, device, dtype)
            else:
                chosen = self._select_best(op, backends, device, dtype)
            self._selection[key] = chosen
            return chosen

    def list_ops(self, device_type: str | None = None) -> list[OpRow]:
        """Every backend of every op, with availability, and which is selected on ``device_type``.

        ``device_type`` defaults to the current accelerator's. Selection here ignores dtype, so
        dtype-restricted backends show as not selected (they are chosen per call, by dtype).
        """
        if device_type is None:
            from slipstream.kernels.accelerator import get_accelerator

            device_type = get_accelerator().device_type
        rows: list[OpRow] = []
        with self._lock:
            for op in self.ops():
                backends = self._op_backends(op)
                try:
                    selected: str | None = self.select(op, device_type)[0]
                except OpUnavailableError:
                    selected = None
                for entry in self._ranked(backends):
                    ok, reason = self._status(entry)
                    rows.append(
                        OpRow(
                            op=op,
                            backend=entry.backend,
                            device_types=tuple(sorted(entry.device_types)),
                            dtypes=None
                            if entry.dtypes is None
                            else tuple(sorted(str(d).removeprefix("torch.") for d in entry.dtypes)),
                            priority=entry.priority,
                            available=ok,
                            reason=reason,
                            selected=entry.backend == selected,
                        )
                    )
        return rows

    # -- internals -------------------------------------------------------------------------
    def _op_backends(self, op: str) -> dict[str, _Backend]:
        self._ensure_builtins()
        backends = self._backends.get(op)
        if backends is None:
            known = ", ".join(sorted(self._backends)) or "none"
            raise UnknownOpError(
                f"unknown op {op!r}; registered ops: {known}. Register it with "
                "slipstream.kernels.register_op() or check the spelling"
            )
        return backends

    @staticmethod
    def _ranked(backends: dict[str, _Backend]) -> list[_Backend]:
        return sorted(backends.values(), key=lambda b: (-b.priority, b.order))

    def _status(self, entry: _Backend) -> tuple[bool, str]:
        if entry.status is not None:
            return entry.status
        status: tuple[bool, str]
        try:
            status = (True, "") if entry.probe is None else entry.probe()
            ok, reason = bool(status[0]), str(status[1])
            status = (ok, reason)
        except Exception as exc:  # a probe must never take training down
            status = (False, f"availability probe raised {type(exc).__name__}: {exc}")
        if status[0]:
            try:
                entry.loaded = _load(entry.target)
            except Exception as exc:  # missing compiler, missing module, broken build
                status = (False, f"loading {entry.target!r} failed: {type(exc).__name__}: {exc}")
        entry.status = status
        return status

    def _select_best(
        self,
        op: str,
        backends: dict[str, _Backend],
        device: str,
        dtype: torch.dtype | None,
    ) -> tuple[str, Callable[..., Any]]:
        candidates = [b for b in self._ranked(backends) if b.supports(device, dtype)]
        skipped: list[tuple[_Backend, str]] = []
        for entry in candidates:
            ok, reason = self._status(entry)
            if ok:
                assert entry.loaded is not None
                for lost, lost_reason in skipped:
                    self._warn_fallback(lost, lost_reason, device, entry.backend)
                return entry.backend, entry.loaded
            skipped.append((entry, reason))
        dtype_note = "" if dtype is None else f" and dtype {dtype}"
        if not candidates:
            raise OpUnavailableError(
                f"op {op!r} has no backend for device type {device!r}{dtype_note}; its "
                f"backends: {_describe(backends)}"
            )
        reasons = "; ".join(f"{b.backend}: {r}" for b, r in skipped)
        raise OpUnavailableError(
            f"op {op!r}: no backend is available on {device!r}{dtype_note} ({reasons})"
        )

    def _select_forced(
        self,
        op: str,
        forced: str,
        backends: dict[str, _Backend],
        device: str,
        dtype: torch.dtype | None,
    ) -> tuple[str, Callable[..., Any]]:
        where = f"{OP_BACKEND_ENV} forces op {op!r} to backend {forced!r}"
        entry = backends.get(forced)
        if entry is None:
            raise OpUnavailableError(
                f"{where}, but {op!r} has no such backend; its backends are "
                f"{', '.join(sorted(backends))}"
            )
        if not entry.supports(device, dtype):
            dtype_note = "" if dtype is None else f" with dtype {dtype}"
            raise OpUnavailableError(
                f"{where}, but that backend does not support device type {device!r}{dtype_note} "
                f"({_describe({forced: entry})}); change or remove the {OP_BACKEND_ENV} entry"
            )
        ok, reason = self._status(entry)
        if not ok:
            raise OpUnavailableError(
                f"{where}, but it is unavailable: {reason}; change or remove the "
                f"{OP_BACKEND_ENV} entry"
            )
        assert entry.loaded is not None
        return entry.backend, entry.loaded

    def _warn_fallback(self, entry: _Backend, reason: str, device: str, fallback: str) -> None:
        key = (entry.op, entry.backend, device)
        if key in self._warned:
            return
        self._warned.add(key)
        logger.warning(
            "op %r: backend %r is unavailable on %s (%s); falling back to %r",
            entry.op,
            entry.backend,
            device,
            reason,
            fallback,
        )


def _describe(backends: dict[str, _Backend]) -> str:
    parts = []
    for entry in backends.values():
        dtypes = "" if entry.dtypes is None else f", dtypes {sorted(map(str, entry.dtypes))}"
        parts.append(f"{entry.backend} (devices {sorted(entry.device_types)}{dtypes})")
    return ", ".join(parts)


def _load(target: Callable[..., Any] | str) -> Callable[..., Any]:
    if not isinstance(target, str):
        return target
    module_name, attribute = target.split(":")
    fn = getattr(importlib.import_module(module_name), attribute)
    if not callable(fn):
        raise TypeError(f"{target!r} is not callable")
    return fn  # type: ignore[no-any-return]


def forced_backends() -> dict[str, str]:
    """Parse ``SLIPSTREAM_OP_BACKEND`` (``"op=backend,op2=backend2"``) into ``{op: backend}``."""
    raw = os.environ.get(OP_BACKEND_ENV, "").strip()
    if not raw:
        return {}
    forced: dict[str, str] = {}
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        op, sep, backend = item.partition("=")
        if not sep or not op.strip() or not backend.strip():
            raise ValueError(
                f"{OP_BACKEND_ENV}={raw!r}: entry {item!r} is not 'op=backend'; write e.g. "
                f"{OP_BACKEND_ENV}=adam=reference,rms_norm=triton"
            )
        forced[op.strip()] = backend.strip()
    return forced


_default_registry = OpRegistry(builtin_module=BUILTIN_OPS_MODULE)


def default_registry() -> OpRegistry:
    """The process-wide registry that the module-level functions use."""
    return _default_registry


def register_op(
    op: str,
    backend: str,
    fn: Callable[..., Any] | str,
    *,
    device_types: Iterable[str],
    dtypes: Iterable[torch.dtype] | None = None,
    priority: int = 0,
    available: Probe | None = None,
    replace: bool = False,
) -> None:
    """Register backend ``backend`` of ``op`` in the process-wide registry.

    Args:
        op: the op's name, e.g. ``"rms_norm"``.
        backend: the backend's name, e.g. ``"reference"``, ``"triton"``, ``"cuda"``, ``"cpu_cpp"``.
        fn: the implementation, or ``"package.module:attribute"`` to import it on first use
            (keeps ``import slipstream.kernels`` cheap and a broken build non-fatal).
        device_types: torch device types it runs on (``"cuda"`` covers ROCm too); ``"*"``
            means every device type (pure-torch code).
        dtypes: the input dtypes it handles; None means any.
        priority: higher wins; the pure-torch reference uses 0.
        available: a probe returning ``(available, reason)``; called once, then cached.
        replace: allow replacing an existing backend of the same name.

    >>> register_op("my_op", "reference", lambda x: x + 1, device_types=("cpu", "cuda"))
    """
    _default_registry.register(
        op,
        backend,
        fn,
        device_types=device_types,
        dtypes=dtypes,
        priority=priority,
        available=available,
        replace=replace,
    )


def get_op(
    op: str, device_type: str | torch.device, dtype: torch.dtype | None = None
) -> Callable[..., Any]:
    """The best available implementation of ``op`` for ``device_type`` (and ``dtype``).

    Raises :class:`UnknownOpError` (a KeyError) for an unknown op and
    :class:`OpUnavailableError` when no backend can run there or a forced one cannot.

    >>> rms_norm = get_op("rms_norm", "cpu", torch.float32)
    """
    return _default_registry.get(op, device_type, dtype)


def list_ops(device_type: str | None = None) -> list[OpRow]:
    """Every registered backend with availability and the selection on ``device_type``."""
    return _default_registry.list_ops(device_type)
