"""The environment report behind ``slipstream report``: software, devices, compilers, ops."""

from __future__ import annotations

import importlib.metadata
import platform
import re
import shutil
import subprocess
import sys
from typing import Any

import torch

from slipstream.kernels.accelerator import cpu_info, get_accelerator
from slipstream.kernels.registry import list_ops

_COMPILER_VERSION_PATTERNS = {
    "nvcc": re.compile(r"release\s+([0-9][0-9.]*)"),
    "hipcc": re.compile(r"HIP version:\s*(\S+)"),
}
_TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton-rocm", "pytorch-triton")


def _distribution_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _compiler(name: str) -> dict[str, str | None]:
    path = shutil.which(name)
    version: str | None = None
    if path is not None:
        try:
            completed = subprocess.run(
                [path, "--version"], capture_output=True, text=True, timeout=20, check=False
            )
            match = _COMPILER_VERSION_PATTERNS[name].search(completed.stdout + completed.stderr)
            version = match.group(1) if match else None
        except (OSError, subprocess.SubprocessError):
            version = None
    return {"path": path, "version": version}


def _distributed_backends() -> dict[str, bool]:
    import torch.distributed as dist

    if not dist.is_available():
        return {"available": False, "nccl": False, "gloo": False, "mpi": False, "ucc": False}
    probes = {
        "nccl": "is_nccl_available",
        "gloo": "is_gloo_available",
        "mpi": "is_mpi_available",
        "ucc": "is_ucc_available",
    }
    result = {"available": True}
    for backend, probe in probes.items():
        check = getattr(dist, probe, None)
        result[backend] = bool(check()) if check is not None else False
    return result


def _accelerator_section() -> dict[str, Any]:
    try:
        accelerator = get_accelerator()
    except (RuntimeError, ValueError) as exc:  # e.g. a bad SLIPSTREAM_ACCELERATOR
        return {"error": str(exc)}
    devices = []
    count = accelerator.device_count()
    for index in range(count):
        devices.append(
            {
                "index": index,
                "name": accelerator.device_name(index),
                "arch": accelerator.arch(index),
                "total_memory_bytes": accelerator.total_memory(index),
            }
        )
    return {
        "name": accelerator.name,
        "device_type": accelerator.device_type,
        "communication_backend": accelerator.communication_backend,
        "backend_library": accelerator.backend_library,
        "runtime_version": accelerator.version(),
        "device_count": count,
        "bf16": accelerator.is_bf16_supported(),
        "fp16": accelerator.is_fp16_supported(),
        "devices": devices,
    }


def _ops_section(device_type: str) -> list[dict[str, Any]]:
    return [
        {
            "op": row.op,
            "backend": row.backend,
            "device_types": list(row.device_types),
            "dtypes": None if row.dtypes is None else list(row.dtypes),
            "priority": row.priority,
            "available": row.available,
            "reason": row.reason,
            "selected": row.selected,
        }
        for row in list_ops(device_type)
    ]


def environment_report() -> dict[str, Any]:
    """Everything ``slipstream report`` shows, as a JSON-ready dict.

    Keys: ``python``, ``platform``, ``torch``, ``accelerator``, ``distributed``, ``triton``,
    ``compilers`` (nvcc, hipcc), ``cpu``, ``extensions`` (each C++/CUDA extension: built in the
    cache, or not) and ``ops`` (one row per op backend, with whether it is selected on this
    accelerator's device type).
    """
    from slipstream.kernels.build_ops import build_status

    accelerator = _accelerator_section()
    info = cpu_info()
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
        "torch": {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "hip": torch.version.hip,
        },
        "accelerator": accelerator,
        "distributed": _distributed_backends(),
        "triton": _distribution_version(_TRITON_DISTRIBUTIONS),
        "compilers": {name: _compiler(name) for name in ("nvcc", "hipcc")},
        "cpu": {
            "model": info.model_name,
            "logical_cores": info.logical_cores,
            "usable_cores": info.usable_cores,
            "simd": list(info.simd),
        },
        "extensions": build_status(),
        "ops": _ops_section(accelerator.get("device_type", "cpu")),
    }


def _yes_no(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes else "-"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return lines


def _section(title: str, items: list[tuple[str, Any]]) -> list[str]:
    width = max(len(key) for key, _ in items)
    return [title, *(f"  {key.ljust(width)} : {_yes_no(value)}" for key, value in items), ""]


def format_report(report: dict[str, Any]) -> str:
    """Render :func:`environment_report` as plain-text sections and tables."""
    lines: list[str] = []
    torch_info = report["torch"]
    lines += _section(
        "Software",
        [
            ("python", f"{report['python']['version']} ({report['python']['executable']})"),
            ("platform", report["platform"]),
            ("torch", torch_info["version"]),
            ("torch CUDA", torch_info["cuda"]),
            ("torch HIP", torch_info["hip"]),
            ("triton", report["triton"]),
        ]
        + [
            (name, f"{c['version'] or 'unknown version'} ({c['path']})" if c["path"] else None)
            for name, c in report["compilers"].items()
        ],
    )
    accelerator = report["accelerator"]
    if "error" in accelerator:
        lines += _section("Accelerator", [("error", accelerator["error"])])
    else:
        lines += _section(
            "Accelerator",
            [
                ("name", accelerator["name"]),
                ("device type", accelerator["device_type"]),
                ("runtime version", accelerator["runtime_version"]),
                (
                    "collectives",
                    f"{accelerator['backend_library']} (torch.distributed backend "
                    f"{accelerator['communication_backend']!r})",
                ),
                ("device count", accelerator["device_count"]),
                ("bf16", accelerator["bf16"]),
                ("fp16", accelerator["fp16"]),
            ],
        )
        if accelerator["device_type"] != "cpu" and accelerator["devices"]:
            rows = [
                [str(d["index"]), d["name"], d["arch"], _gib(d["total_memory_bytes"])]
                for d in accelerator["devices"]
            ]
            lines += [*_table(["index", "device", "arch", "memory"], rows), ""]
    dist = report["distributed"]
    lines += _section(
        "torch.distributed",
        [(key, dist[key]) for key in ("available", "nccl", "gloo", "mpi", "ucc")],
    )
    cpu = report["cpu"]
    lines += _section(
        "CPU",
        [
            ("model", cpu["model"]),
            ("cores", f"{cpu['usable_cores']} usable of {cpu['logical_cores']} logical"),
            ("SIMD", " ".join(cpu["simd"]) or "-"),
        ],
    )
    lines += _section(
        "C++ extensions (prebuild: python -m slipstream.kernels.build_ops)",
        sorted(report.get("extensions", {}).items()),
    )
    op_rows = [
        [
            row["op"],
            row["backend"],
            ",".join(row["device_types"]),
            "any" if row["dtypes"] is None else ",".join(row["dtypes"]),
            str(row["priority"]),
            _yes_no(row["available"]),
            "*" if row["selected"] else "",
            row["reason"],
        ]
        for row in report["ops"]
    ]
    device = accelerator.get("device_type", "cpu")
    lines.append(f"Ops (selected = chosen on device type {device!r} when no dtype restricts it)")
    lines += _table(
        ["op", "backend", "devices", "dtypes", "priority", "available", "selected", "reason"],
        op_rows,
    )
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    """Print the report (``python -m slipstream.kernels.report``)."""
    print(format_report(environment_report()), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
