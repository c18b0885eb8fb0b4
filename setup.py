from setuptools import Extension, setup

# The native pieces, each a GIL-free loop: memcpy over (dst, src, length) runs, and
# stat() over a batch of paths on a thread of its own.
setup(
    ext_modules=[
        Extension(
            "kvtier._native.copy_runs",
            sources=["kvtier/_native/copy_runs.c"],
            extra_compile_args=["-O3"],
        ),
        Extension(
            "kvtier._native.stat_batch",
            sources=["kvtier/_native/stat_batch.c"],
            extra_compile_args=["-O2", "-Wall"],
        ),
    ]
)
