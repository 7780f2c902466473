"""A hash of each quantized GEMV specialisation's PTX / AMDGCN with the debug line info stripped.

A refactor of the Triton source that must not change what runs (e.g. a loop moved into a shared
``@triton.jit`` helper) is checked by running this before and after on the same Triton and
diffing the output: equal hashes mean equal device code, so no timing can differ. No GPU needed
(``triton.compile`` for ``GPUTarget``s)::

    PYTHONPATH=kernels/src python3 tools/bench/kernel_codegen_hash.py sm_90 gfx942 > after.txt
"""

import dataclasses
import hashlib
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from slipstream.kernels.aot import TARGETS
from slipstream.kernels.ops.quant_matmul import fused_gemv, gemv

specs = [s for s in gemv.aot_specs() if "dense" not in s.name]
for half2 in (False, True):
    specs += fused_gemv.aot_specs(half2)
# fp8 through the fused kernel (its fp32 path), native and not
base = fused_gemv.aot_specs(False)[0]
for native in (False, True):
    specs.append(
        dataclasses.replace(
            base,
            name=base.name + f"fp8native{native}",
            constexprs={**base.constexprs, "FORMAT": 2, "NATIVE_FP8": native, "HALF2": False},
        )
    )
for target in sys.argv[1:]:
    for spec in specs:
        if target == "gfx942" and spec.constexprs.get("HALF2"):
            continue
        if target == "gfx942" and spec.constexprs.get("NATIVE_FP8"):
            continue
        src = ASTSource(fn=spec.kernel, signature=spec.signature, constexprs=spec.constexprs)
        c = triton.compile(src, target=GPUTarget(*TARGETS[target]))
        text = c.asm.get("ptx") or c.asm.get("amdgcn")
        if isinstance(text, bytes):
            text = text.decode()
        text = re.split(r"\n\s*\.section\s+\.debug", text)[0]
        body = "\n".join(
            line
            for line in text.splitlines()
            if not re.match(r"\s*(\.loc|\.file|//|;|\$L__tmp\d+:|\.Ltmp\d+:)", line)
        )
        print(target, spec.name, hashlib.sha1(body.encode()).hexdigest()[:12], flush=True)
