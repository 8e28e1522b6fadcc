#!/usr/bin/env bash
# Run here (CPU machine, package index), from the repo root, before a GPU run of the whole test
# suite: downloads into .whl/ (ignored by git, about 18 MB) what the tests need that the GPU
# machine's image lacks (the image's list: the device library's KINDS.md): e3nn-jax (the
# oracle), ase, vesin (JequiCalculator's neighbour list), dm-haiku (the Haiku layers) and the notebook
# stack (tests/test_main_and_notebook.py).
# Carry ".whl" alone: with .peers (49 MB, the peers for benchmarks) it would pass the device's
# 64 MiB limit. benchmarks/device_env.sh installs the wheels under /tmp/site.
set -euo pipefail
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .whl \
  e3nn-jax==0.21.0 ase==3.29.0 dm-haiku==0.0.17 jmp==0.0.4 \
  nbformat==5.11.1 nbclient==0.11.0 ipykernel==7.4.0 jupyter-client==8.10.0 jupyter-core==5.9.1 traitlets==5.16.1 \
  fastjsonschema==2.22.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  platformdirs==4.14.8 pyzmq==27.3.0 tornado==6.6.1 comm==0.2.3 debugpy==1.8.22 nest-asyncio2==1.7.4 \
  ipython==9.18.1 ipython-pygments-lexers==1.1.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2 \
  pexpect==4.9.0 ptyprocess==0.7.0 prompt-toolkit==3.0.53 wcwidth==0.9.4 stack-data==0.6.3 asttokens==3.0.2 \
  executing==2.3.0 pure-eval==0.2.4 vesin==0.6.2
du -sh .whl
