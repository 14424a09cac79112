"""The one compiled piece: the offload tier's streaming-store copy (``_stream_copy.c``).

Optional: without a C compiler the install still succeeds and block copies fall back to
numpy's memcpy (slower, same results); ``kvserve.kv.offload.block_copy.NATIVE`` says which.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvserve.kv.offload._stream_copy",
            ["src/kvserve/kv/offload/_stream_copy.c"],
            optional=True,
        )
    ]
)
