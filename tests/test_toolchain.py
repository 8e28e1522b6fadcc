"""Where the cuda backend's compiler comes from, and that losing it is said: nvcc from the pip
wheels' layouts (a pip-only install has no system toolkit), and one warning naming the reason
on a GPU machine without a toolchain."""

import importlib
import os
import sys
import warnings

import jax
import pytest

from ffi import build, ops


def _fake_wheel(root, rel):
    nvcc = root / "nvidia" / rel
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    return nvcc


@pytest.mark.parametrize("rel", build.WHEEL_NVCC)
def test_nvcc_found_in_the_wheels_without_a_system_toolkit(tmp_path, monkeypatch, rel):
    nvcc = _fake_wheel(tmp_path, rel)
    if rel.startswith("cuda_nvcc"):  # the CUDA 12 wheels: the runtime headers in their own tree
        (tmp_path / "nvidia" / "cuda_runtime" / "include").mkdir(parents=True)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-toolkit"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    importlib.invalidate_caches()
    assert build.nvcc() == str(nvcc)
    includes = build.nvcc_includes(str(nvcc))
    assert includes == ([f"-I{(tmp_path / 'nvidia' / 'cuda_runtime' / 'include').resolve()}"] if rel.startswith("cuda_nvcc") else [])


def test_nvcc_absent_everywhere_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-toolkit"))
    monkeypatch.setattr(build, "wheel_nvcc", lambda: None)
    assert build.nvcc() is None


def test_a_gpu_without_toolchain_warns_once_with_the_reason(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(build, "toolchain_missing", lambda: "nvcc was not found (test)")
    ops._warn_unbuildable.cache_clear()
    with pytest.warns(RuntimeWarning, match=r"'cuda' backend cannot be built.*nvcc was not found \(test\).*'pallas' instead"):
        assert ops.available() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.available() is False  # once a process, not at every product
    ops._warn_unbuildable.cache_clear()


@pytest.mark.skipif(build.cxx() is None, reason="no C++ compiler")
def test_launcher_builds_and_registers_on_this_jaxlib(tmp_path):
    """The FFI handler compiles against the installed jaxlib's headers and registers with JAX
    (no GPU needed for either), in a process of its own: this process's handler, where a GPU
    test has loaded it, holds the registered kernels. CI installs the newest jaxlib the index
    serves; the GPU image has 0.11.2, whose GPU runs call it."""
    import pathlib
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    code = "from ffi import build; lib = build.launcher(); assert lib.JequiLaunch and lib.jequi_register_kernel; print('ok')"
    env = {**os.environ, "JEQUI_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
    assert any(p.suffix == ".so" for p in tmp_path.rglob("*"))
