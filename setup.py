"""twinflow's build. The C++ kernel is compiled on first use (JIT, cached);
set TWINFLOW_BUILD_EXT=1 to compile it here instead, which needs torch in the
build environment: `TWINFLOW_BUILD_EXT=1 pip install --no-build-isolation .`
"""

import os
import re

from setuptools import find_packages, setup

KERNEL_SOURCES = ["csrc/cpu_adam.cpp", "csrc/kernel_scalar.cpp", "csrc/kernel_avx2.cpp", "csrc/kernel_avx512.cpp"]

ext_modules, cmdclass = [], {}
if os.environ.get("TWINFLOW_BUILD_EXT") == "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    ext_modules = [
        CppExtension(
            "twinflow._C",
            KERNEL_SOURCES,
            extra_compile_args=["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno"],
            extra_link_args=["-fopenmp", "-lstdc++"],
        )
    ]
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(
    name="twinflow",
    version=re.search(r'__version__ = "(.+)"', open("twinflow/version.py", encoding="utf-8").read())[1],
    description="Adam with a configurable share of the optimizer step on the CPU (Twin-Flow offload)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["twinflow", "twinflow.*"]),
    # torch is deliberately unpinned: install the build for your machine first (CPU only:
    # `pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu`), and pip keeps it.
    install_requires=["torch>=2.4", "numpy", "ninja", "pydantic>=2.6"],
    extras_require={
        # Everything the test suite runs: the examples and benchmarks it drives (matplotlib for their
        # plots), and the clients (Hugging Face transformers and accelerate, Lightning) it drives twinflow from.
        "test": [
            "pytest>=8",
            "ruff==0.17.6",
            "tqdm",
            "transformers>=4.46",
            "accelerate>=1.1",
            "matplotlib",
            "lightning>=2.4",
            # the compact device step's Triton kernel, checked on the CPU by Triton's interpreter (a GPU build of
            # torch brings its own Triton, which pip keeps)
            "triton; platform_system == 'Linux' and platform_machine == 'x86_64'",
        ],
        # accelerate: transformers.Trainer refuses to run without it
        "examples": ["tqdm", "transformers>=4.46", "accelerate>=1.1", "matplotlib"],
        "compare": ["deepspeed"],
        # the documentation site (mkdocs.yml): `mkdocs build --strict`, as CI runs it
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
