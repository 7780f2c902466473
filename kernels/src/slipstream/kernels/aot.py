"""Compile every Triton kernel ahead of time for NVIDIA and AMD targets, without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget(...))`` runs Triton's whole pipeline (TTIR,
TTGIR, LLVM IR, then PTX + cubin through the bundled ``ptxas``, or AMDGCN + hsaco through the
bundled LLVM/``ld.lld``) for a named target, so CI proves that each kernel builds for MI200,
MI300, RX 7900, A100 and H100 on a machine that has none of them::

    python -m slipstream.kernels.aot                       # the whole matrix, a report, exit 1 on failure
    python -m slipstream.kernels.aot --targets gfx942 sm_90 --kernels rms_norm --out build/aot

Run it without ``TRITON_INTERPRET=1``: under the interpreter ``@triton.jit`` functions are
interpreted Python and cannot be compiled.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slipstream.kernels.triton_support import INTERPRET_ENV, AotSpec, interpreting, triton_probe

# name -> (backend, arch, warp size) as triton.backends.compiler.GPUTarget takes them.
TARGETS: dict[str, tuple[str, int | str, int]] = {
    "sm_80": ("cuda", 80, 32),  # A100
    "sm_90": ("cuda", 90, 32),  # H100 / H200
    "gfx90a": ("hip", "gfx90a", 64),  # MI200 (wave64)
    "gfx942": ("hip", "gfx942", 64),  # MI300 (wave64)
    "gfx1100": ("hip", "gfx1100", 32),  # RX 7900 (RDNA3, wave32)
}

# Every module holding Triton kernels; each exposes aot_specs() -> list[AotSpec].
KERNEL_MODULES = (
    "slipstream.kernels.ops.rms_norm.triton",
    "slipstream.kernels.ops.layer_norm.triton",
    "slipstream.kernels.ops.softmax.triton",
    "slipstream.kernels.ops.rotary_embedding.triton",
    "slipstream.kernels.ops.cross_entropy.triton",
    "slipstream.kernels.ops.adam.triton",
    "slipstream.kernels.ops.lion.triton",
    "slipstream.kernels.ops.lamb.triton",
    "slipstream.kernels.ops.quantize.triton",
    "slipstream.kernels.ops.paged_attention.triton",
    "slipstream.kernels.ops.quant_matmul.triton",
    "slipstream.kernels.ops.quant_matmul.fused_gemv",
    "slipstream.kernels.ops.rotary_kv_write.triton",
    "slipstream.kernels.ops.add_rms_norm.triton",
    "slipstream.kernels.ops.gated_activation.triton",
    "slipstream.kernels.ops.moe_gemv.triton",
    "slipstream.kernels.ops.decode_gemv.triton",
    "slipstream.kernels.ops.decode_attention.triton",
    "slipstream.kernels.ops.argmax.triton",
    "slipstream.kernels.ops.decode_inputs.triton",
)

_BINARY_KINDS = ("cubin", "hsaco")


@dataclass(frozen=True)
class AotResult:
    """The outcome of compiling one kernel specialisation for one target."""

    kernel: str
    target: str
    ok: bool
    seconds: float
    binary: str | None  # "cubin" or "hsaco"
    binary_bytes: int
    error: str


def all_specs(kernels: Iterable[str] | None = None) -> list[AotSpec]:
    """Every registered specialisation, or those whose name contains one of ``kernels``."""
    wanted = list(kernels or [])
    specs: list[AotSpec] = []
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(module_name)
        for spec in module.aot_specs():
            if not wanted or any(piece in spec.name for piece in wanted):
                specs.append(spec)
    return specs


def one_spec_per_kernel(specs: Sequence[AotSpec]) -> list[AotSpec]:
    """The first specialisation of each distinct ``@triton.jit`` function (a quick matrix)."""
    seen: set[int] = set()
    chosen = []
    for spec in specs:
        if id(spec.kernel) not in seen:
            seen.add(id(spec.kernel))
            chosen.append(spec)
    return chosen


def _check_environment() -> None:
    ok, reason = triton_probe()
    if not ok:
        raise RuntimeError(f"AOT compilation needs Triton: {reason}")
    if interpreting():
        raise RuntimeError(
            f"{INTERPRET_ENV}=1 is set, so @triton.jit kernels are interpreted Python and cannot "
            f"be compiled; run the AOT build without {INTERPRET_ENV}"
        )


def compile_spec(spec: AotSpec, target: str, out_dir: Path | None = None) -> AotResult:
    """Compile ``spec`` for ``target`` (a key of :data:`TARGETS`); never raises on a bad build."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if target not in TARGETS:
        raise ValueError(f"unknown AOT target {target!r}; choose from {sorted(TARGETS)}")
    start = time.perf_counter()
    try:
        source = ASTSource(fn=spec.kernel, signature=spec.signature, constexprs=spec.constexprs)
        compiled = triton.compile(source, target=GPUTarget(*TARGETS[target]))
        kind = next((k for k in _BINARY_KINDS if k in compiled.asm), None)
        binary = compiled.asm[kind] if kind else b""
        if not binary:
            raise RuntimeError(f"no device binary produced (stages: {sorted(compiled.asm)})")
        if out_dir is not None:
            folder = out_dir / target
            folder.mkdir(parents=True, exist_ok=True)
            safe = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in spec.name)
            (folder / f"{safe}.{kind}").write_bytes(binary)
        return AotResult(
            spec.name, target, True, time.perf_counter() - start, kind, len(binary), ""
        )
    except Exception as exc:  # report every failure, keep compiling the rest
        message = f"{type(exc).__name__}: {exc}".strip().splitlines()
        return AotResult(
            spec.name,
            target,
            False,
            time.perf_counter() - start,
            None,
            0,
            " | ".join(message[:6])[:2000],
        )


def compile_matrix(
    targets: Sequence[str] | None = None,
    kernels: Iterable[str] | None = None,
    *,
    quick: bool = False,
    out_dir: Path | None = None,
    progress: bool = False,
) -> list[AotResult]:
    """Compile the selected specialisations for each target; one :class:`AotResult` each.

    ``quick`` compiles one specialisation per distinct kernel function (every kernel, fewer
    dtype/flag variants). Raises RuntimeError when Triton is missing or interpreting.
    """
    _check_environment()
    chosen_targets = list(targets or TARGETS)
    unknown = [t for t in chosen_targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"unknown AOT targets {unknown}; choose from {sorted(TARGETS)}")
    specs = all_specs(kernels)
    if quick:
        specs = one_spec_per_kernel(specs)
    if not specs:
        raise ValueError(f"no Triton kernel matches {list(kernels or [])}")
    results = []
    for target in chosen_targets:
        for spec in specs:
            result = compile_spec(spec, target, out_dir)
            results.append(result)
            if progress:
                status = "ok  " if result.ok else "FAIL"
                print(f"{status} {target:8s} {spec.name} ({result.seconds:.2f}s)", flush=True)
    return results


def format_summary(results: Sequence[AotResult]) -> str:
    """A table of compiled/total per target, then every failure with its error."""
    lines = ["target    compiled  binary  seconds"]
    by_target: dict[str, list[AotResult]] = {}
    for result in results:
        by_target.setdefault(result.target, []).append(result)
    for target, rows in by_target.items():
        good = sum(r.ok for r in rows)
        kinds = {r.binary for r in rows if r.binary}
        seconds = sum(r.seconds for r in rows)
        kind = ",".join(sorted(k for k in kinds if k)) or "-"
        lines.append(f"{target:9s} {good:3d}/{len(rows):<4d} {kind:7s} {seconds:7.1f}")
    failures = [r for r in results if not r.ok]
    for result in failures:
        lines.append(f"FAILED {result.target} {result.kernel}: {result.error}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m slipstream.kernels.aot``: compile the matrix, print a report, exit 1 on failure."""
    parser = argparse.ArgumentParser(prog="python -m slipstream.kernels.aot", description=__doc__)
    parser.add_argument("--targets", nargs="+", choices=sorted(TARGETS), help="default: all")
    parser.add_argument("--kernels", nargs="+", help="only specs whose name contains one of these")
    parser.add_argument("--quick", action="store_true", help="one specialisation per kernel")
    parser.add_argument("--out", type=Path, help="write binaries and report.json here")
    parser.add_argument("--verbose", action="store_true", help="one line per compile")
    args = parser.parse_args(argv)
    try:
        results = compile_matrix(
            args.targets, args.kernels, quick=args.quick, out_dir=args.out, progress=args.verbose
        )
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(results))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report: dict[str, Any] = {
            "triton": _triton_version(),
            "results": [asdict(r) for r in results],
        }
        (args.out / "report.json").write_text(json.dumps(report, indent=2))
    return 0 if all(r.ok for r in results) else 1


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


if __name__ == "__main__":
    raise SystemExit(main())
