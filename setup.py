from setuptools import Extension, setup

# The one native piece: a GIL-free loop of memcpy over (dst, src, length) runs.
setup(
    ext_modules=[
        Extension(
            "kvtier._native.copy_runs",
            sources=["kvtier/_native/copy_runs.c"],
            extra_compile_args=["-O3"],
        )
    ]
)
