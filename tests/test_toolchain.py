"""Where the cuda backend's compiler comes from, and that losing it is said: nvcc from the pip
wheels' layouts (a pip-only install has no system toolkit), and one warning naming the reason
on a GPU machine without a toolchain."""

import importlib
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
