"""How fast the GPU's L2 takes the traffic of two conv-backward designs on the carbon graph
(MACE-large sizes; GPU run, CuPy). Before an atomic (receiver-walk) conv backward was built:

* ``gather-gz``: the deterministic backward's dominant stream: per edge (sender order) the
  receiver's cotangent row (DOUT floats), summed so the loads are not dropped;
* ``atomic-gx``: a receiver walk's ``gx`` scatter: per edge (receiver order) D1 floats added to
  the sender's row (``red.global.add``, float4 or scalar);
* ``gather-x``: per edge (receiver order) the sender's ``x`` row (D1 floats), the forward's gather;
* ``stream-w``: per edge a weight row (NW floats) read once, and written once (``gw``).

    python3 benchmarks/atomic_probe.py [--dtype float32]
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

import structures

D1, DOUT, NW = 1152, 9088, 2176

SOURCE = r"""
typedef %(T)s T;
template <int D>  // per edge of each node's walk, the other node's row of D values, summed
__device__ void gather(const T* __restrict__ rows, const int* __restrict__ other, const int* __restrict__ offsets,
                       T* __restrict__ out) {
  const int node = blockIdx.x; T acc = 0;
  for (int k = offsets[node]; k < offsets[node + 1]; ++k) {
    const T* row = rows + (long long)other[k] * D;
    for (int j = threadIdx.x; j < D; j += blockDim.x) acc += __ldg(row + j);
  }
  out[node * blockDim.x + threadIdx.x] = acc;
}
extern "C" __global__ void gather_gz(const T* gz, const int* other, const int* offsets, T* out) {
  gather<DOUT>(gz, other, offsets, out);
}
extern "C" __global__ void gather_x(const T* x, const int* other, const int* offsets, T* out) {
  gather<D1>(x, other, offsets, out);
}
extern "C" __global__ void atomic_gx(T* __restrict__ gx, const int* __restrict__ other,
                                     const int* __restrict__ offsets) {
  const int r = blockIdx.x;
  for (int k = offsets[r]; k < offsets[r + 1]; ++k) {
    T* row = gx + (long long)other[k] * D1;
#if VEC
    for (int j = threadIdx.x * 4; j < D1; j += blockDim.x * 4)
      atomicAdd(reinterpret_cast<float4*>(row + j), make_float4(T(k), T(j), T(1), T(2)));
#else
    for (int j = threadIdx.x; j < D1; j += blockDim.x) atomicAdd(row + j, T(k));
#endif
  }
}
extern "C" __global__ void stream_w(const T* __restrict__ w, T* __restrict__ gw, const int* __restrict__ order,
                                    const int* __restrict__ offsets) {
  const int r = blockIdx.x;
  for (int k = offsets[r]; k < offsets[r + 1]; ++k) {
    const long long e = order[k];
    for (int j = threadIdx.x; j < NW; j += blockDim.x) __stcs(gw + e * NW + j, T(2) * __ldcs(w + e * NW + j));
  }
}
"""


def timed(f, repeat=20):
    f()
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(5):
        start.record()
        for _ in range(repeat):
            f()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / repeat)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--graph", default="carbon")
    a = ap.parse_args()
    dtype = np.dtype(a.dtype)
    _, _, g = structures.radius_graph(a.graph)
    n, e = g.num_nodes, g.num_edges
    recv_other = cp.asarray(np.asarray(g.receiver_senders), cp.int32)
    recv_order = cp.asarray(np.asarray(g.receiver_order), cp.int32)
    recv_off = cp.asarray(np.append(np.asarray(g.receiver_offsets), e), cp.int32)
    send_other = cp.asarray(np.asarray(g.sender_receivers), cp.int32)
    send_off = cp.asarray(np.asarray(g.sender_offsets), cp.int32)
    T = "float" if dtype == np.float32 else "double"
    print(f"{a.graph}: {n} nodes, {e} edges, {dtype.name}", flush=True)
    for vec in ((1, 0) if dtype == np.float32 else (0,)):
        src = f"#define D1 {D1}\n#define DOUT {DOUT}\n#define NW {NW}\n#define VEC {vec}\n" + SOURCE % {"T": T}
        mod = cp.RawModule(code=src, options=("-std=c++17", "-arch=sm_90"))
        gz, x, w = (cp.ones((rows, d), dtype) for rows, d in ((n, DOUT), (n, D1), (e, NW)))
        gx, gw = cp.zeros((n, D1), dtype), cp.empty((e, NW), dtype)
        item = dtype.itemsize
        for threads in (128, 288, 576):
            out = cp.empty((n, threads), dtype)
            runs = {
                "gather-gz": (lambda: mod.get_function("gather_gz")((n,), (threads,), (gz, send_other, send_off, out)), e * DOUT * item),
                "gather-x": (lambda: mod.get_function("gather_x")((n,), (threads,), (x, recv_other, recv_off, out)), e * D1 * item),
                f"atomic-gx{' v4' if vec else ''}": (lambda: mod.get_function("atomic_gx")((n,), (threads,), (gx, recv_other, recv_off)), e * D1 * item),
                "stream-w": (lambda: mod.get_function("stream_w")((n,), (threads,), (w, gw, recv_order, recv_off)), 2 * e * NW * item),
            }
            for name, (f, nbytes) in runs.items():
                if vec == 0 and name != "atomic-gx" and dtype == np.float32:
                    continue
                ms = timed(f)
                print(f"{name:14s} threads {threads:4d}: {ms:.3f} ms, {nbytes / ms / 1e9:.2f} TB/s of {nbytes / 1e9:.2f} GB", flush=True)


if __name__ == "__main__":
    main()
