import platform

from setuptools import Extension, setup

X86 = platform.machine().lower() in ("x86_64", "amd64")

# The native pieces, each a GIL-free loop: memcpy over (dst, src, length) runs (hashing
# what they write with xxHash's xxh3, from third_party/xxhash), and stat() over a batch
# of paths on a thread of its own.
setup(
    ext_modules=[
        Extension(
            "kvtier._native.copy_runs",
            sources=["kvtier/_native/copy_runs.c"] + (["third_party/xxhash/xxh_x86dispatch.c"] if X86 else []),
            include_dirs=["third_party/xxhash"],
            depends=["third_party/xxhash/xxhash.h", "third_party/xxhash/xxh_x86dispatch.h"],
            extra_compile_args=["-O3"],
        ),
        Extension(
            "kvtier._native.stat_batch",
            sources=["kvtier/_native/stat_batch.c"],
            extra_compile_args=["-O2", "-Wall"],
        ),
    ]
)
