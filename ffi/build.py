"""Building and calling the generated CUDA kernels.

* Kernels: ``nvcc -cubin`` for the GPU's architecture, cached on disk by content
  (:data:`CACHE_DIR`), with ptxas' resource report beside each cubin (:func:`resources`).
* The one XLA FFI handler (``ffi/launcher.cc``): compiled once per machine with the host C++
  compiler against jaxlib's FFI headers, loaded with ctypes and registered with JAX as the
  target ``jequi_launch``.
* :func:`call` registers a kernel's cubin with the handler under its content hash and returns
  the ``jax.ffi.ffi_call`` of it, batched by ``jax.vmap`` as extra grid rows
  (``vmap_method="broadcast_all"``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import re
import shutil
import struct
import subprocess
import tempfile

import jax
import numpy as np

from . import codegen

TARGET = "jequi_launch"
_HERE = pathlib.Path(__file__).parent
CACHE_DIR = pathlib.Path(
    os.environ.get("JEQUI_CACHE_DIR") or pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "jequi"
)
NVCC_FLAGS = ("-cubin", "-O3", "-std=c++17", "-lineinfo", "-Xptxas", "-v")


# Where the CUDA compiler wheels put nvcc, under each folder of the ``nvidia`` namespace
# package: ``pip install "jax[cuda13]"`` brings nvidia-cuda-nvcc (cu13: the whole toolkit
# in one tree), the CUDA 12 wheels a tree per component.
WHEEL_NVCC = ("cu13/bin/nvcc", "cu12/bin/nvcc", "cuda_nvcc/bin/nvcc")


def wheel_nvcc() -> str | None:
    """nvcc from the pip wheels (:data:`WHEEL_NVCC`), or None."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        for rel in WHEEL_NVCC:
            path = pathlib.Path(root) / rel
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    return None


def nvcc_includes(compiler: str) -> list[str]:
    """Extra ``-I`` flags for a wheel's nvcc: the CUDA 12 wheels keep ``cuda_runtime.h``
    (which nvcc includes into every source) in a sibling tree, ``nvidia/cuda_runtime``."""
    runtime = pathlib.Path(compiler).resolve().parents[2] / "cuda_runtime" / "include"
    return [f"-I{runtime}"] if pathlib.Path(compiler).parent.parent.name == "cuda_nvcc" and runtime.is_dir() else []


def nvcc() -> str | None:
    """The CUDA compiler: ``nvcc`` on PATH, under ``$CUDA_HOME`` / ``$CUDA_PATH`` /
    ``/usr/local/cuda``, or from the ``nvidia-cuda-nvcc`` wheel (:func:`wheel_nvcc`): a
    pip-only install has no system toolkit."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    path = pathlib.Path(home) / "bin" / "nvcc"
    return str(path) if path.exists() else wheel_nvcc()


def cxx() -> str | None:
    """The host C++ compiler for the FFI handler."""
    return next((shutil.which(c) for c in (os.environ.get("CXX") or "", "c++", "g++") if c and shutil.which(c)), None)


@functools.cache
def toolchain_missing() -> str | None:
    """Why kernels cannot be built here, or None (looked up once per process)."""
    if nvcc() is None:
        return "nvcc was not found (PATH, $CUDA_HOME, /usr/local/cuda, the nvidia-cuda-nvcc wheel)"
    if cxx() is None:
        return "no C++ compiler was found ($CXX, c++, g++)"
    if not (pathlib.Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "ffi.h").exists():
        return "jaxlib's FFI headers are missing"
    return None


def gpu_arch() -> str:
    """``sm_XY`` of the default GPU (``sm_90`` where there is none: what CPU tests compile for)."""
    try:
        cc = jax.devices("gpu")[0].compute_capability
    except (RuntimeError, AttributeError):
        return "sm_90"
    return "sm_" + cc.replace(".", "")


def _cached(parts: tuple, suffix: str, make) -> pathlib.Path:
    """The cache file for `parts`; `make(path)` writes it once (atomically)."""
    key = hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:32]
    path = CACHE_DIR / f"{key}{suffix}"
    if not path.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
            out = pathlib.Path(tmp) / path.name
            make(out)
            log = out.with_suffix(".log")
            if log.exists():  # before the file, whose existence says both are there
                os.replace(log, path.with_suffix(".log"))
            os.replace(out, path)
    return path


def _run(cmd: list[str], what: str, log: pathlib.Path | None = None):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(cmd[:2])} ...):\n{proc.stderr[-4000:]}")
    if log is not None:
        log.write_text(proc.stderr)


def cubin(source: str, arch: str | None = None) -> pathlib.Path:
    """The cubin of `source` for `arch` (default: this machine's GPU), compiled once."""
    arch = arch or gpu_arch()
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError(toolchain_missing())
    version = _version(compiler)

    def make(out: pathlib.Path):
        src = out.with_suffix(".cu")
        src.write_text(source)
        _run([compiler, *NVCC_FLAGS, *nvcc_includes(compiler), f"-arch={arch}", str(src), "-o", str(out)], "nvcc", out.with_suffix(".log"))

    return _cached((source, arch, version, NVCC_FLAGS), f"-{arch}.cubin", make)


@functools.cache
def _version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


def resources(path: pathlib.Path) -> dict:
    """Registers, spill bytes and stack frame of a cubin, from ptxas' report."""
    text = path.with_suffix(".log").read_text() if path.with_suffix(".log").exists() else ""
    found = lambda pattern: int(m.group(1)) if (m := re.search(pattern, text)) else None  # noqa: E731
    return {
        "registers": found(r"Used (\d+) registers"),
        "spill_stores": found(r"(\d+) bytes spill stores"),
        "spill_loads": found(r"(\d+) bytes spill loads"),
        "stack": found(r"(\d+) bytes stack frame"),
    }


def code_bytes(path: pathlib.Path) -> int:
    """Bytes of machine code in cubin `path`: the sizes of its executable ELF sections."""
    data = path.read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":
        raise ValueError(f"{path} is not a little-endian ELF64 cubin")
    (table,) = struct.unpack_from("<Q", data, 0x28)  # e_shoff
    size, count = struct.unpack_from("<HH", data, 0x3A)  # e_shentsize, e_shnum
    sections = [struct.unpack_from("<IIQQQQ", data, table + i * size) for i in range(count)]
    return sum(s[5] for s in sections if s[2] & 0x4)  # sh_size where sh_flags has SHF_EXECINSTR


# A Hopper (sm_90) multiprocessor's limits, for :func:`resident_warps`: registers of each of its
# four sub-partitions (a warp's registers come from one), warps, blocks, shared memory, and the
# shared memory the runtime reserves per block.
SMSP_REGISTERS, SM_WARPS, SM_BLOCKS, SM_SMEM, BLOCK_SMEM = 16384, 64, 32, 228 * 1024, 1024


def resident_warps(path: pathlib.Path, threads: int, smem: int) -> int:
    """Warps of the kernel in cubin `path` (`threads` per block, `smem` bytes of dynamic shared
    memory) that one multiprocessor holds at once, by the CUDA occupancy calculator's rules
    for Hopper (registers allocated per warp in units of 256, shared memory per block in units
    of 128 bytes); other GPUs hold fewer warps or less shared memory, so there it is an estimate."""
    warps = -(-threads // 32)
    per_warp = -(-resources(path)["registers"] * 32 // 256) * 256
    by_registers = SMSP_REGISTERS // per_warp * 4 // warps
    by_smem = SM_SMEM // (-(-(smem + BLOCK_SMEM) // 128) * 128)
    return min(SM_BLOCKS, SM_WARPS // warps, by_registers, by_smem) * warps


@functools.cache
def launcher() -> ctypes.CDLL:
    """The FFI handler library, built once per machine and registered with JAX."""
    source = (_HERE / "launcher.cc").read_text()
    include = jax.ffi.include_dir()
    compiler = cxx()
    if compiler is None:
        raise RuntimeError(toolchain_missing())

    def make(out: pathlib.Path):
        cmd = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{include}", str(_HERE / "launcher.cc"), "-o", str(out), "-ldl"]
        _run(cmd, "building the FFI handler")

    path = _cached((source, include, compiler, jax.__version__), ".so", make)
    lib = ctypes.CDLL(str(path))
    lib.jequi_register_kernel.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int64, ctypes.c_char_p]
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JequiLaunch), platform="CUDA")
    return lib


@functools.lru_cache(maxsize=None)
def register(source: str, entry: str) -> str:
    """Compile `source`, hand its cubin (kernel `entry`) to the handler and return the name
    calls use."""
    path = cubin(source)
    image = path.read_bytes()
    name = "jequi_" + path.stem
    launcher().jequi_register_kernel(name.encode(), image, len(image), entry.encode())
    return name


def call(kernel: codegen.Kernel, args, out_types, grid_x: int, unit: int, scalars, zero=()):
    """Run `kernel` on `args` (arrays), returning results of `out_types`
    (``jax.ShapeDtypeStruct``\\ s): grid ``(grid_x, B)`` where ``B = args[0].size // unit``;
    the results numbered in `zero` are zeroed first."""
    name = register(kernel.source, kernel.entry)
    fn = jax.ffi.ffi_call(TARGET, out_types, vmap_method="broadcast_all")
    return fn(
        *args,
        kernel=name,
        grid_x=np.int64(grid_x),
        unit=np.int64(unit),
        threads=np.int64(kernel.threads),
        smem=np.int64(kernel.smem),
        zero=np.int64(sum(1 << i for i in zero)),
        scalars=np.asarray(scalars, np.int64),
    )
