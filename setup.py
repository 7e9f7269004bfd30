"""The compiled part of tserve: its CPU kernels, one shared library loaded with ctypes.

Built by ``pip install`` (editable installs build it in place). The C code
picks its instruction set at run time from the CPU's flags, so the library
built on one x86-64 machine runs on any other (see tserve/gpu/kernels/_cpu_kernels.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tserve.gpu.kernels._kernels",
            sources=[
                "tserve/gpu/kernels/_cpu_kernels.c",
                "tserve/gpu/kernels/_quant_kernels.c",
                "tserve/gpu/kernels/_kquant_kernels.c",
                "tserve/gpu/kernels/_attention_kernels.c",
                "tserve/gpu/kernels/_decoder_kernels.c",
                "tserve/gpu/kernels/_sampling_kernels.c",
            ],
            depends=[
                "tserve/gpu/kernels/_glue.h",
                "tserve/gpu/kernels/_kernels.h",
                "tserve/gpu/kernels/_quant_common.h",
                "tserve/gpu/kernels/_panel_common.h",
                "tserve/gpu/kernels/_attention_tile.h",
            ],
            extra_compile_args=["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"],
            # torch's own OpenMP runtime (the same libgomp.so.1) once torch is imported
            extra_link_args=["-fopenmp"],
            libraries=["m"],
        )
    ]
)
