"""The Triton KV quantization kernels compiled for a CUDA GPU, read without one.

Compiles each kernel as :mod:`kvdiag.kernels.quant_triton` launches it for an fp16 KV tensor
(tiles, warps, and the JIT's specializations: an input stride of 1 as a constant, sizes and
pointers divisible by 16) for ``--arch`` with the ptxas bundled with triton, and prints per
kernel: tokens per program, warps, registers per thread, shared memory bytes, global loads and
stores per thread by width (``v4.b32`` = 16 bytes), and SASS instructions per value (a static
count, slow paths included). It measures no speed: it shows whether the accesses are whole
vectors and how much code a value costs. Writes only to a temporary folder.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

FORMATS = (("fp8_e4m3", 8, True), ("int8", 8, False), ("int4", 4, False), ("int2", 2, False))


def _nvidia_bin(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def compile_kernel(fn, signature: dict, constexprs: dict, num_warps: int, arch: int):
    """``triton.compile`` of ``fn`` for ``cuda:arch``; ints and pointers of ``signature`` other
    than H (the head count) are marked divisible by 16, as the JIT does for such values."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    order = {name: i for i, name in enumerate(fn.arg_names)}
    full = dict(signature, **{k: "constexpr" for k in constexprs})
    full = dict(sorted(full.items(), key=lambda kv: order[kv[0]]))
    attrs = {(order[k],): [["tt.divisibility", 16]] for k in signature if k != "H"}
    src = ASTSource(fn, full, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def global_accesses(ptx: str) -> dict:
    """Global loads and stores in the PTX, by instruction (one per thread each)."""
    return dict(Counter(m.replace("global.", "") for m in re.findall(r"(?:ld|st)\.global(?:\.\w+)+", ptx)))


def sass_stats(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, SASS instructions) of a one-kernel cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([_nvidia_bin("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([_nvidia_bin("cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    return int(regs.group(1)) if regs else -1, len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))


def kernels(head_dim: int, group: int, tokens: int):
    """(name, fn, signature, constexprs, warps, tokens per program) for each format and axis, as
    quant_triton launches them on [B, H, tokens, head_dim] fp16."""
    from kvdiag.kernels import quant_triton as qt

    for fmt, bits, fp8 in FORMATS:
        payload = "*fp8e4nv" if fp8 else "*u8"
        for axis in ("token", "channel"):
            channel = axis == "channel"
            g = group if channel else min(group, head_dim)
            rows, warps = qt._tile(tokens, head_dim, qt.CHANNEL_ROWS, g) if channel else qt._tile(tokens, head_dim, qt.TOKEN_ROWS)
            common = dict(D=head_dim, G=g, PPB=8 // bits, BITS=bits, CHANNEL=channel, FP8=fp8)
            qsig = {"x_ptr": "*fp16", "out_ptr": payload, "scale_ptr": "*fp16", "zero_ptr": "*fp16",
                    "H": "i32", "T": "i32", "sB": "i32", "sH": "i32", "sT": "i32"}
            qconst = dict(common, ROWS=rows, sD=1, FMAX=448.0 if fp8 else 1.0, MANT=3, EMIN=-6,
                          SUB_UP=2.0 ** 9, SUB_DN=2.0 ** -9)
            yield f"quant {fmt} {axis}", qt._quant_kernel, qsig, qconst, warps, rows
            drows, dwarps = qt._tile(1 << 20, head_dim, qt.TOKEN_ROWS, g if channel else 1)
            dsig = {"q_ptr": payload, "scale_ptr": "*fp16", "zero_ptr": "*fp16", "out_ptr": "*fp16", "n_rows": "i32"}
            yield f"dequant {fmt} {axis}", qt._dequant_kernel, dsig, dict(common, ROWS=drows), dwarps, drows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per (batch, head) stream")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    cache = tempfile.TemporaryDirectory()
    os.environ["TRITON_CACHE_DIR"] = cache.name  # compiled kernels go to a temporary folder
    print(f"sm_{args.arch}, head_dim {args.head_dim}, group {args.group}; per thread: global accesses; "
          f"instr/value = SASS instructions x threads / values per program")
    print(f"{'kernel':24s} {'rows':>4s} {'warps':>5s} {'regs':>4s} {'shared':>6s} {'instr/value':>11s}  global accesses")
    for name, fn, sig, const, warps, rows in kernels(args.head_dim, args.group, args.tokens):
        k = compile_kernel(fn, sig, const, warps, args.arch)
        regs, n_sass = sass_stats(k.asm["cubin"])
        per_value = n_sass * 32 * warps / (rows * args.head_dim)
        print(f"{name:24s} {rows:4d} {warps:5d} {regs:4d} {k.metadata.shared:6d} {per_value:11.1f}  "
              f"{global_accesses(k.asm['ptx'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
