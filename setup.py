"""The compiled pieces, both optional: without a C compiler the install still succeeds.

- ``kvserve.kv.offload._stream_copy``: the offload tier's streaming-store copy; without it block
  copies fall back to numpy's memcpy (``kvserve.kv.offload.block_copy.NATIVE``).
- ``kvserve.kv.backends._fs_read``: the fs tier's read of a group of chunk files without the
  GIL; without it the tier reads them in Python (``kvserve.kv.backends.fs.NATIVE_READ``).
- ``kvserve.engine.attention._paged_attention``: the CPU paged-attention kernel; without it the
  torch backend serves (``kvserve.engine.attention.native_backend.AVAILABLE``). Built with
  OpenMP where the compiler has it (else single-threaded), -O3 and no -march: the kernel
  carries its own AVX-512 / AVX2 / baseline variants, chosen at import.
- ``kvserve.model._fused_ops``: one-pass RMSNorm, RoPE and SiLU-and-mul; without it the torch
  ops run (``kvserve.model.fused_ops.AVAILABLE``). Same flags plus -ffp-contract=off (torch's
  roundings, op by op).
"""

import os
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Headers shared by the C extensions (bf16 <-> fp32 conversion).
CSRC = "src/kvserve/csrc"


def _compiler_accepts(compiler, flags: list[str]) -> bool:
    """Whether ``compiler`` compiles and links a small OpenMP program with ``flags``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n")
        try:
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=flags)
            compiler.link_executable(objs, "probe", output_dir=tmp, extra_postargs=flags)
        except Exception:
            return False
    return True


class BuildExt(build_ext):
    """The attention kernel gets -O3, and -fopenmp where the compiler supports it (GCC,
    Clang with libomp)."""

    def build_extension(self, ext: Extension) -> None:
        native = ext.name.endswith(("_paged_attention", "_fused_ops"))
        if native and self.compiler.compiler_type == "unix":
            ext.extra_compile_args = [*ext.extra_compile_args, "-O3", "-std=gnu11", "-Wno-psabi"]
            if ext.name.endswith("_fused_ops"):
                ext.extra_compile_args = [*ext.extra_compile_args, "-ffp-contract=off"]
            if _compiler_accepts(self.compiler, ["-fopenmp"]):
                ext.extra_compile_args = [*ext.extra_compile_args, "-fopenmp"]
                ext.extra_link_args = [*ext.extra_link_args, "-fopenmp"]
            else:  # no OpenMP runtime: one thread, `omp simd` loops still vectorized
                ext.extra_compile_args = [*ext.extra_compile_args, "-fopenmp-simd"]
        super().build_extension(ext)


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "kvserve.kv.offload._stream_copy",
            ["src/kvserve/kv/offload/_stream_copy.c"],
            optional=True,
        ),
        Extension(
            "kvserve.kv.backends._fs_read",
            ["src/kvserve/kv/backends/_fs_read.c"],
            optional=True,
        ),
        Extension(
            "kvserve.engine.attention._paged_attention",
            ["src/kvserve/engine/attention/_paged_attention.c"],
            include_dirs=[CSRC],
            depends=["src/kvserve/engine/attention/_paged_attention_vec.h", f"{CSRC}/bf16.h"],
            optional=True,
        ),
        Extension(
            "kvserve.model._fused_ops",
            ["src/kvserve/model/_fused_ops.c"],
            include_dirs=[CSRC],
            depends=[f"{CSRC}/bf16.h"],
            optional=True,
        ),
    ],
)
