"""The generated kernels of a handful of descriptors as text, one file per kernel: the CUDA C
source of every kind ``ffi.codegen`` builds (forward, backward, double backward sums, conv,
per-row and shared weights, a few configs) and the lowered module of ``jax.jit`` of the Pallas
backend's forward, backward, fused double backward and conv calls (interpret mode on CPU).
Run before and after a refactor and diff the directories: the kernels did not change if they
are identical (about 12 minutes on a 2-core CPU, the CUDA part seconds; no GPU needed).

    python benchmarks/dump_generated_code.py OUT_DIR [all|cuda|pallas]
    diff -r BEFORE_DIR AFTER_DIR
"""
import dataclasses, itertools, pathlib, sys
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import numpy as np
import jequi
from jequi import problems
from jequi.sums import Sums

out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
only = sys.argv[2] if len(sys.argv) > 2 else "all"
print("jequi from", jequi.__file__)

def tp(name):
    return {
        "cw": lambda: jequi.channelwise("32x0e+16x1o+8x2e", "0e+1o+2e", "0e+1o+2e"),
        "cw_irmul": lambda: jequi.channelwise("32x0e+16x1o+8x2e", "0e+1o+2e", "0e+1o+2e", layout="ir_mul"),
        "wide": lambda: jequi.channelwise("128x0e+128x1o", "0e+1o", "0e+1o"),
        "wide_irmul": lambda: jequi.channelwise("128x0e+128x1o", "0e+1o", "0e+1o", layout="ir_mul"),
        "water": lambda: problems.get("nequip-water"),
        "uvw": lambda: jequi.fully_connected("8x0e+4x1o", "0e+1o", "8x0e+4x1o"),
        "diffdock": lambda: problems.get("diffdock-l1"),
        "tetris": lambda: problems.get("tetris-poly-1"),
    }[name]()

SECONDS = [Sums.of((True, True, True, True), (True, True, True)),
           Sums.of((True, False, True, True), (True, False, False)),
           Sums.of((False, True, True, False), (True, True, True))]

def write(name, text):
    (out / name).write_text(text)

# ---- CUDA ---------------------------------------------------------------------------------
def cuda():
    import ffi
    from ffi import codegen, launch, schedule
    base = ffi.Config()
    variants = {"default": base, "gm": dataclasses.replace(base, batched_group_major=True),
                "bw4": dataclasses.replace(base, block_warps=4), "mw0": dataclasses.replace(base, min_warps=0),
                "f64wide": dataclasses.replace(base, batched_forward_registers=256, batched_forward_rows=1)}
    sums_list = {"fwd": launch.FIRST_ORDER, "gx": Sums.gradients((True, False, False)), "gyw": Sums.gradients((False, True, True))}
    for i, s in enumerate(SECONDS):
        sums_list[f"sec{i}"] = s
    n = 0
    for name in ("cw", "cw_irmul", "wide", "wide_irmul", "water"):
        desc = tp(name).descriptor.trilinear
        for dtype, kind, (sn, sums), shared, (vn, cfg) in itertools.product(
            (np.float32, np.float64), launch.KINDS, sums_list.items(), (False, True), variants.items()):
            if vn != "default" and (sn not in ("fwd", "sec0") or shared):
                continue
            try:
                k = codegen.generate(desc, np.dtype(dtype), kind, sums, shared, cfg)
                text = k.source + f"\n// launch {k.threads} {k.smem} {k.chunk} {k.groups} {k.group_major} {k.arrays} {len(k.programs)}\n"
            except (ValueError, AssertionError) as e:
                text = f"ERROR {type(e).__name__}: {e}\n"
            write(f"cuda__{name}__{np.dtype(dtype).name}__{kind}__{sn}__{'shared' if shared else 'rows'}__{vn}.cu", text)
            n += 1
        u = desc.untouched
        write(f"cuda__{name}__untouched.txt", repr((u.x, u.w, u.out)) + repr(ffi.ops.unsupported_reason(desc)) + repr(schedule.backward_footprint(desc)))
    print("cuda kernels", n)

# ---- Pallas -------------------------------------------------------------------------------
def pallas():
    bp = jequi.backends.BACKENDS["pallas"]
    n = 0
    def lower(name, f, *args):
        nonlocal n
        text = jax.jit(f).lower(*args).as_text()
        write(name + ".hlo", text); n += 1
    rng = np.random.default_rng(0)
    for name in ("cw", "cw_irmul", "wide", "water", "uvw", "diffdock", "tetris"):
        t = tp(name)
        desc = t.descriptor.trilinear
        d1, d2, do = desc.dims
        nw = desc.weight_numel
        for dtype in (np.float32, np.float64):
            N = 7
            x, y, w, gz = (jnp.asarray(rng.normal(size=s), dtype) for s in ((N, d1), (N, d2), (N, nw), (N, do)))
            ws = jnp.asarray(rng.normal(size=(nw,)), dtype)
            tag = f"pallas__{name}__{np.dtype(dtype).name}"
            lower(tag + "__fwd", lambda x, y, w: bp.forward(desc, x, y, w), x, y, w)
            lower(tag + "__fwd_shared", lambda x, y, w: bp.forward(desc, x, y, w), x, y, ws)
            lower(tag + "__bwd", lambda x, y, w, g: bp.backward(desc, x, y, w, g), x, y, w, gz)
            lower(tag + "__bwd_gx", lambda x, y, w, g: bp.backward(desc, x, y, w, g, (True, False, False)), x, y, w, gz)
            lower(tag + "__bwd_shared", lambda x, y, w, g: bp.backward(desc, x, y, w, g), x, y, ws, gz)
            for i, spec in enumerate(SECONDS):
                arrays = (x, y, w, gz, x * 2, y * 2, w * 2)
                lower(tag + f"__second{i}", lambda *a, spec=spec: bp.second(desc, spec, a), *arrays)
            # conv
            nodes, E = 5, 11
            senders = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 7]); receivers = np.array([1, 2, 3, 4, 0, 0, 0, 0, 1, 1, 2])
            graph = jequi.Graph.build(jnp.asarray(senders), jnp.asarray(receivers), nodes)
            xn = jnp.asarray(rng.normal(size=(nodes, d1)), dtype)
            ye, we, gn = (jnp.asarray(rng.normal(size=s), dtype) for s in ((E, d2), (E, nw), (nodes, do)))
            if name in ("wide",):
                continue
            lower(tag + "__conv_fwd", lambda x, y, w, g: bp.conv_forward(desc, x, y, w, g), xn, ye, we, graph)
            lower(tag + "__conv_fwd_kahan", lambda x, y, w, g: bp.conv_forward(desc, x, y, w, g, kahan=True), xn, ye, we, graph)
            lower(tag + "__conv_bwd", lambda x, y, w, go, g: bp.conv_backward(desc, x, y, w, go, g), xn, ye, we, gn, graph)
            lower(tag + "__conv_bwd_kahan_gw", lambda x, y, w, go, g: bp.conv_backward(desc, x, y, w, go, g, (False, False, True), kahan=True), xn, ye, we, gn, graph)
            lower(tag + "__conv_second0", lambda *a: bp.conv_second(desc, SECONDS[0], a[:7], a[7]), xn, ye, we, gn, xn * 2, ye * 2, we * 2, graph)
    print("pallas kernels", n)

if only in ("all", "cuda"): cuda()
if only in ("all", "pallas"): pallas()
