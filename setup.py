from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup

# the extensions' C++ files compile in parallel, one job a core (SPECDEC_BUILD_JOBS sets another count)
ParallelCompile("SPECDEC_BUILD_JOBS").install()

# The hostfunc extension needs only the Python and pybind11 headers: the CUDA driver entry points are
# resolved at run time (dlopen libcuda), so it builds on machines with no CUDA toolkit or GPU.
ext_modules = [
    Pybind11Extension("hostfunc._C", ["hostfunc/csrc/hostfunc.cpp", "hostfunc/csrc/step_launch.cpp"], cxx_std=17,
                      libraries=["dl"]),
    # The grammar node calls xgrammar's matchers through tvm-ffi's C ABI and llguidance's through its C API, both
    # resolved at run time (libtvm_ffi, llguidance's extension).
    Pybind11Extension("engine.guided._native", ["engine/guided/csrc/grammar_node.cpp", "engine/guided/csrc/node.cpp",
                                                 "engine/guided/csrc/llg.cpp", "engine/guided/csrc/llg_py.cpp",
                                                 "engine/guided/csrc/closing.cpp", "engine/guided/csrc/closing_py.cpp"],
                      depends=glob("engine/guided/csrc/*.h"), cxx_std=17, libraries=["dl"], extra_compile_args=["-O2"]),
    # a plain step's decode rows into a slot's host buffers (engine/runner/rows.py): the Python and pybind11 headers
    Pybind11Extension("engine.runner._rows", ["engine/runner/csrc/rows.cpp"], cxx_std=17, extra_compile_args=["-O2"]),
    # the host's walks over a step's rows (engine/scheduler.py, engine/commit.py, the guided snapshot): the Python
    # and pybind11 headers
    Pybind11Extension("engine.requests._hostpath", ["engine/requests/csrc/hostpath.cpp",
                                                    "engine/requests/csrc/commit_walk.cpp",
                                                    "engine/requests/csrc/guided_walk.cpp",
                                                    "engine/requests/csrc/publish_walk.cpp"],
                      depends=glob("engine/requests/csrc/*.h"), cxx_std=17,
                      extra_compile_args=["-O2"]),
    # CPU matmuls of a few rows (AVX2 + FMA, chosen at run time): needs only the pybind11 headers
    Pybind11Extension("engine.kernels.matmul._cpu_gemm", ["engine/kernels/matmul/csrc/cpu_gemm.cpp"], cxx_std=17,
                      extra_compile_args=["-O3"], extra_link_args=["-pthread"]),
]

setup(
    name="specdec",
    version="0.1.0",
    description="Low-latency LLM inference for JSON-schema-constrained tool calls",
    packages=find_packages(include=["engine*", "specdec*", "hostfunc*"]),
    python_requires=">=3.10",
    # xgrammar and llguidance pinned: the grammar node binds to their C ABIs, the GPU machine stages these versions,
    # and tests hold their measured behaviour (xgrammar 0.2.9 compiles tests/server/test_server_hostile.py's slow schema
    # inside its time budget and fixed the cache failure tests/guided/test_compile_pool.py provokes)
    install_requires=[
        "torch>=2.6", "transformers>=4.56", "tokenizers", "safetensors", "gguf>=0.10", "xgrammar==0.2.8",
        "llguidance==1.9.1", "numpy", "tqdm", "pybind11>=2.12", "fastapi>=0.110", "uvicorn>=0.30",
        "prometheus-client>=0.20", "pyzmq>=25", "msgspec>=0.18",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "ruff>=0.6", "accelerate", "jsonschema", "triton>=3.2",
                 "openai>=1.40", "httpx"],
        "bench": ["matplotlib"],
        # engine/server/ray_serve.py, tests/server/test_ray_serve.py (not in `make test`: ~500 MB)
        "ray": ["ray[serve]>=2.40"],
        # client libraries checked against `specdec serve` (tests/server/test_clients.py; not in `make test`: ~350 MB)
        "clients": ["openai-agents==0.24.0", "pydantic-ai-slim[openai]==2.38.0", "langchain-openai==1.7.4",
                    "instructor==1.17.0", "litellm==1.110.2"],
    },
    entry_points={"console_scripts": ["specdec=engine.cli:main"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
