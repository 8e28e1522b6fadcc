"""The CUDA JIT backend (``ffi/``). On CPU: its schedule reproduces the descriptor's CG blocks
and every generated kernel compiles with nvcc (skipped without one). On a GPU: the kernels
against the pure-JAX reference, batched and as the conv, f32 and f64, every derivative order,
edge cases of graphs, vmap, and bitwise determinism."""

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, check_batched, random_inputs

import jequi
from ffi import build, build_search, codegen, ctext, launch, ops, schedule
from ffi.config import DEFAULT
from jequi.sums import BACKWARD, FORWARD, GGW, GGX, GGY, GZ, W, X, Y, Sums

ON_GPU = "cuda" in jequi.available_backends()
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU and nvcc (the cuda backend)")

PROBLEMS = {
    "uvu": lambda: jequi.channelwise("3x0e+2x1o+5x2e", "0e+1o+2e", "0e+1o+2e+3o"),
    "uvu-in2-mul": lambda: jequi.TensorProduct("5x1o", "3x2e", "5x3o", [(0, 0, 0, "uvu", True)]),
    "uvu+unweighted": lambda: jequi.TensorProduct(
        "4x0e+3x1o", "0e+1o", "4x1o+3x1e+3x0e", [(0, 1, 0, "uvu", True), (1, 1, 1, "uvu", False), (1, 1, 2, "uvu", True, 0.5)]
    ),
    "l6": lambda: jequi.channelwise("2x6e", "0e+1o+6e", "0e+5o+6e"),
    "uvu-ir_mul": lambda: jequi.channelwise("3x0e+2x1o+5x2e", "0e+1o+2e", "0e+1o+2e+3o", layout="ir_mul"),
    "wide": lambda: jequi.channelwise("40x0e+33x1o", "0e+1o+2e", "0e+1o+2e"),  # a partial second warp
    # 4, 2 and 1 channels per lane (float32; 2, 2, 1 in float64)
    "vec": lambda: jequi.channelwise("128x0e+64x1o+32x2e", "0e+1o+2e", "0e+1o+2e+3o"),
    "vec-ir_mul": lambda: jequi.channelwise("128x0e+64x1o+32x2e", "0e+1o+2e", "0e+1o+2e+3o", layout="ir_mul"),
    # an input segment and output segments that no path reaches: their gradient and values are zero
    "unreached": lambda: jequi.TensorProduct("2x0e+3x1o", "0e+1o", "2x1o+2x0e+3x2e", [(0, 1, 0, "uvu", True)]),
    # an output segment reached from two x segments (no tp_second: ffi.schedule.outputs_follow_x)
    "merged": lambda: jequi.TensorProduct("2x0e+2x1o", "0e+1o", "2x1o", [(0, 1, 0, "uvu", True), (1, 0, 0, "uvu", True)]),
}
if ON_GPU:
    for n in ("mace-large", "nequip-oam-main", "nequix-first"):
        PROBLEMS[n] = functools.partial(jequi.problems.get, n)
    PROBLEMS["mace-large-ir_mul"] = functools.partial(jequi.problems.get, "mace-large", layout="ir_mul")

TOL = {np.float32: 5e-5, np.float64: 1e-11}
DTYPES = (np.float32, np.float64)
BATCH = 301  # odd: a partial last block for every rows-per-block setting (Config.batched_*_rows)


def test_schedule_reproduces_the_cg_blocks():
    """The A entries' literal coefficients, summed back per term, are the descriptor's
    normalized CG block of each path, and the programs partition the terms."""
    for make in PROBLEMS.values():
        desc = make().descriptor.trilinear
        terms = schedule.terms(desc)
        for t in terms:
            cg = np.zeros_like(t.cg)
            for i, k in t.entries:
                for position, c in t.entry_terms(i, k):
                    j = int(np.nonzero(t.y_positions == position)[0][0])
                    cg[i, j, k] += c
            np.testing.assert_allclose(cg, t.cg, atol=1e-15)
            dense = np.zeros_like(t.cg)
            for i, j, k, c in t.nonzeros:
                dense[i, j, k] = c
            np.testing.assert_allclose(dense, t.cg, atol=1e-15)
        for programs in (schedule.forward_programs(desc, np.float32, 8), schedule.backward_programs(desc, np.float32, 16)):
            assert sorted(id(t) for p in programs for t in p.terms) == sorted(id(t) for t in terms)
            assert all(t.x.mul == p.mul for p in programs for t in p.terms)
        owners = [{s.offset for s in p.x_segments} for p in schedule.backward_programs(desc, np.float32, 16)]
        assert sum(map(len, owners)) == len(set().union(*owners))  # backward programs own whole x segments


def test_forward_programs_respect_the_register_budget():
    desc = jequi.problems.get("mace-large").descriptor.trilinear
    for dtype, words in ((np.float32, 1), (np.float64, 2)):
        for budget in (16, 40, 64):
            for p in schedule.forward_programs(desc, dtype, budget):
                assert sum(s.ir_dim for s in p.out_segments) * words <= budget


def test_batched_forward_holds_one_segment_of_sums():
    """A batched forward stores each output segment before it declares the next one's sums,
    so its register budget counts the largest segment's (fewer, larger programs); the conv
    forward, whose sums run over a receiver's edges, stores them all after its walk. Its
    float64 lanes take one channel (the conv forward's two)."""
    desc = jequi.problems.get("mace-large", layout="ir_mul").descriptor.trilinear
    for dtype in (np.float32, np.float64):
        for budget in (40, 64, 96):
            held = schedule.forward_programs(desc, dtype, budget, 2, one_segment=True)
            assert len(held) <= len(schedule.forward_programs(desc, dtype, budget, 2))
        assert len(schedule.forward_programs(desc, dtype, 64, 2, one_segment=True)) < len(schedule.forward_programs(desc, dtype, 64, 2))
    for name in ("vec", "vec-ir_mul"):
        source = codegen.generate(PROBLEMS[name]().descriptor.trilinear, np.float32, "tp_forward").source
        events = [(m.group(1) or m.group(2), bool(m.group(1))) for m in re.finditer(r"T acc(\d+)_0_0 = 0|\+ bo(\d+) \+", source)]
        declared = [o for o, decl in events if decl]
        assert len(declared) == len(set(declared)) > 1
        for (o, decl), (_, next_decl) in zip(events, events[1:]):
            if decl:
                assert not next_decl, o  # a segment's sums are stored before the next segment's are declared
    conv = codegen.generate(PROBLEMS["vec-ir_mul"]().descriptor.trilinear, np.float32, "conv_forward").source
    assert conv.index("+ bo") > conv.index("for (int base = start; base < end; base += K)")
    vec = PROBLEMS["vec-ir_mul"]().descriptor.trilinear
    assert {p.channels for p in codegen.generate(vec, np.float64, "tp_forward").programs} == {1}
    assert max(p.channels for p in codegen.generate(vec, np.float64, "conv_forward").programs) == 2


def test_channels_per_lane():
    """Lanes take as many channels as fill whole warps with aligned vectors (16 bytes at most),
    and one where weights of consecutive channels are not adjacent."""
    desc = PROBLEMS["vec"]().descriptor.trilinear
    for dtype, expected in ((np.float32, {128: 4, 64: 2, 32: 1}), (np.float64, {128: 2, 64: 2, 32: 1})):
        forward = schedule.forward_programs(desc, dtype, 1000, 4)
        assert {p.mul: p.channels for p in forward} == expected
        # the backward's heaviest segment (32x2e) keeps one, the lightest (128x0e) takes all a
        # float32 lane may (float64 lanes keep one)
        backward = {p.mul: p.channels for p in schedule.backward_programs(desc, dtype, 1000, 4)}
        assert backward[32] == 1 and backward[64] <= expected[64]
        assert backward[128] == (4 if dtype == np.float32 else 1)
        assert all(p.warps * schedule.LANES * p.channels == p.mul for p in forward)
    assert {p.channels for p in schedule.forward_programs(desc, np.float32, 1000, 1)} == {1}
    # the lanes of four channels move them as one float4 per component, in either layout; the
    # conv forward takes Config.forward_channels, the other kinds Config.channels
    four = dataclasses.replace(DEFAULT, forward_channels=4)
    for name in ("vec", "vec-ir_mul"):
        desc = PROBLEMS[name]().descriptor.trilinear
        source = codegen.generate(desc, np.float32, "conv_forward", config=four).source
        assert "reinterpret_cast<const T4*>" in source and "MAKE4(" in source
        forward = codegen.generate(desc, np.float32, "conv_forward")
        assert max(p.channels for p in forward.programs) == DEFAULT.forward_channels
    # a batched product in mul_ir: its forward keeps one channel per lane and streams its rows,
    # its backward takes several and reads the rows (a lane's adjacent values) through L1
    desc = PROBLEMS["vec"]().descriptor.trilinear
    forward, backward = (codegen.generate(desc, np.float32, kind) for kind in ("tp_forward", "tp_backward"))
    assert {p.channels for p in forward.programs} == {1} and "__ldcs(xr_n + " in forward.source
    assert max(p.channels for p in backward.programs) == 4 and "__ldcs(xr_n + " not in backward.source
    assert "reinterpret_cast<const T4*>(xr_n + " in backward.source
    # in ir_mul too the backward reads its rows through L1 (measured faster), the forward streams them
    desc = PROBLEMS["vec-ir_mul"]().descriptor.trilinear
    forward_ir, backward_ir = (codegen.generate(desc, np.float32, kind).source for kind in ("tp_forward", "tp_backward"))
    assert "__ldcs(reinterpret_cast<const T4*>(xr_n + " in forward_ir
    assert "__ldg(reinterpret_cast<const T4*>(xr_n + " in backward_ir and "__ldcs(reinterpret_cast<const T4*>(xr_n + " not in backward_ir
    assert "__ldg(reinterpret_cast<const T4*>(gr_n + " in backward_ir
    # ... and the forward moves a warp's 32 channels of a segment through shared memory whole
    assert "tb[lane * 3 + 2] = " in forward.source and "tb[lane * 3 + 2] = " not in backward.source
    wide = codegen.generate(PROBLEMS["wide"]().descriptor.trilinear, np.float32, "tp_forward").source
    assert "if (lane + 64 < staged * 3) __stcs(" in wide  # 33 channels: the second warp moves 1 x 3 values
    in2 = jequi.TensorProduct("128x1o", "2x2e", "128x3o", [(0, 0, 0, "uvu", True)]).descriptor.trilinear
    assert [p.channels for p in schedule.forward_programs(in2, np.float32, 1000, 4)] == [1]
    # a backward lane's values (per channel) fit the budget, whatever it took to make them fit
    for p in schedule.backward_programs(jequi.problems.get("mace-large").descriptor.trilinear, np.float32, 128, 4):
        assert sum(schedule._held(list(p.terms), s, p.channels, p.prefetch) for s in p.x_segments) <= 128


def test_conv_backward_heaviest_segment_channels():
    """A float32 conv backward gives its heaviest ``x`` segment
    ``Config.conv_backward_heaviest_channels`` channels per lane (lighter segments as many more
    as balance the warps' work, up to ``Config.channels``); the batched backward keeps one,
    float64 lanes one."""
    desc = jequi.problems.get("mace-large", layout="ir_mul").descriptor.trilinear
    heaviest = max((t.x for t in schedule.terms(desc)), key=lambda s: s.ir_dim)
    channels = lambda kind, dtype=np.float32, **knobs: {  # noqa: E731
        s.ir_dim: p.channels
        for p in codegen.generate(desc, dtype, kind, config=dataclasses.replace(DEFAULT, **knobs)).programs
        for s in p.x_segments
    }
    assert DEFAULT.conv_backward_heaviest_channels == 2
    for kind in ("conv_backward", "conv_atomic_backward"):
        assert channels(kind) == {1: 4, 3: 2, heaviest.ir_dim: 2}
        assert channels(kind, conv_backward_heaviest_channels=1) == {1: 4, 3: 2, heaviest.ir_dim: 1}
        assert set(channels(kind, np.float64).values()) == {1}
    assert channels("tp_backward")[heaviest.ir_dim] == 1
    # lighter segments scale with it (where the value budget allows): 1o takes twice its one-
    # channel share, not just as many as the heaviest
    share = lambda h: {s.ir_dim: p.channels for p in schedule.backward_programs(desc, np.float32, 1000, 4, heaviest=h) for s in p.x_segments}  # noqa: E731
    assert share(1) == {1: 4, 3: 2, 5: 1} and share(2) == {1: 4, 3: 4, 5: 2}
    for bad in (0, 3):
        with pytest.raises(ValueError, match="power of two"):
            schedule.backward_programs(desc, np.float32, 128, 4, heaviest=bad)


def test_lane_channels_share_the_gy_coefficients():
    """A lane sums its channels' ``x * w * gz`` products per ``(i, k)`` before the CG
    coefficients spread them into gy: one multiply-add per coefficient and lane, whatever its
    channels."""
    desc = jequi.problems.get("mace-large", layout="ir_mul").descriptor.trilinear
    kernel = codegen.generate(desc, np.float32, "conv_backward")
    assert max(p.channels for p in kernel.programs) > 1
    assert len(re.findall(r"gy\d+ = fma\(", kernel.source)) == sum(len(t.nonzeros) for t in schedule.terms(desc))


def test_l2_prefetch_distances():
    """The conv forward asks L2 for weight rows ``l2_prefetch`` edges ahead, the backward
    ``backward_l2_prefetch`` ahead and never for the gathered cotangent rows (they mostly hit
    L2 already); 0 asks for nothing."""
    desc = PROBLEMS["uvu-ir_mul"]().descriptor.trilinear
    config = dataclasses.replace(DEFAULT, l2_prefetch=3, backward_l2_prefetch=2)
    forward = codegen.generate(desc, np.float32, "conv_forward", config=config).source
    backward = codegen.generate(desc, np.float32, "conv_backward", config=config).source
    assert "pk = base + kk + 3;" in forward and "prw" in forward
    assert "pk = base + kk + 2;" in backward and "prw" in backward
    prefetched = [line for line in backward.splitlines() if "const char* pr" in line]
    assert prefetched and all("(w + (long long)order[pk] * NW)" in line for line in prefetched)  # never gz
    none = dataclasses.replace(config, l2_prefetch=0, backward_l2_prefetch=0)
    for kind in ("conv_forward", "conv_backward"):
        assert "prefetch.global.L2" not in codegen.generate(desc, np.float32, kind, config=none).source


def test_float64_backward_runs_one_program_per_block():
    """A batched float64 backward with per-row weights gives each program its own blocks,
    program-major; float32, shared weights and the conv keep several programs per block."""
    desc = PROBLEMS["vec-ir_mul"]().descriptor.trilinear
    split = codegen.generate(desc, np.float64, "tp_backward")
    assert split.groups == len(split.programs) > 1
    assert split.threads == schedule.LANES * max(p.warps for p in split.programs)
    assert "const int group = blockIdx.x / nodes, node = blockIdx.x % nodes;" in split.source
    kept = [codegen.generate(desc, np.float32, "tp_backward"), codegen.generate(desc, np.float64, "tp_backward", shared=True),
            codegen.generate(desc, np.float64, "tp_forward"), codegen.generate(desc, np.float64, "conv_backward")]  # fmt: skip
    for k in kept:
        assert k.groups == 1 and "blockIdx.x / nodes" not in k.source, k.kind


def test_unsupported_modes_are_reported():
    tp = jequi.fully_connected("2x0e", "0e", "2x0e")
    assert "uvw" in ops.unsupported_reason(tp.descriptor.trilinear)
    with pytest.raises(ValueError, match="cuda backend runs"):
        jequi.backends.BACKENDS["cuda"].check(tp.descriptor.trilinear)
    assert ops.unsupported_reason(PROBLEMS["uvu"]().descriptor.trilinear) is None


# the fused double backward's sums: every term at once, and the double backward of gpu_benchmark.py
SECOND = Sums(((GGX, Y, W), (X, GGY, W), (X, Y, GGW)), ((GGY, W), (Y, GGW)), ((GGX, W), (X, GGW)), ((GGX, Y), (X, GGY)))
SECOND_BENCH = Sums((), ((GGY, W),), ((GGX, W),), ((GGX, Y), (X, GGY)))
COMPILE_CASES = [
    ("uvu", np.float32, "conv_forward", (True, True, True), False),
    ("uvu", np.float64, "conv_backward", (True, True, True), False),
    ("uvu-ir_mul", np.float32, "conv_backward", (True, False, True), True),
    ("uvu-in2-mul", np.float64, "tp_forward", (True, True, True), True),
    ("uvu+unweighted", np.float32, "tp_backward", (False, True, False), False),
    ("l6", np.float64, "tp_backward", (True, True, True), True),
    ("wide", np.float32, "conv_backward", (False, True, True), False),
    ("vec", np.float32, "conv_backward", (True, True, True), False),
    ("vec-ir_mul", np.float64, "conv_forward", (True, True, True), True),
    ("vec-ir_mul", np.float32, "tp_backward", (False, True, True), True),
    ("vec-ir_mul", np.float32, "tp_forward", SECOND, False),
    ("vec-ir_mul", np.float32, "tp_backward", SECOND_BENCH, False),
    ("uvu-in2-mul", np.float64, "conv_forward", SECOND, True),
    ("wide", np.float32, "conv_backward", SECOND, False),
    ("vec", np.float64, "tp_backward", SECOND, True),
    ("vec-ir_mul", np.float32, "tp_second", SECOND, False),
    ("vec", np.float64, "tp_second", SECOND, True),
    ("wide", np.float32, "tp_second", SECOND, False),
    ("uvu", np.float64, "conv_atomic_backward", (True, True, True), True),
    ("vec", np.float32, "conv_atomic_backward", (True, True, True), False),
    ("vec-ir_mul", np.float32, "conv_atomic_backward", (True, False, True), False),
    ("wide", np.float32, "conv_atomic_backward", SECOND, False),
    ("vec-ir_mul", np.float64, "conv_atomic_backward", SECOND_BENCH, True),
    # the catalogue's widest batched forward (19,968 outputs a row), one segment's sums at a time
    ("nequip-benzene", np.float32, "tp_forward", (True, True, True), False),
    ("nequip-benzene-ir_mul", np.float64, "tp_forward", (True, True, True), False),
    # half-precision storage (widened to float32 where it is used), every kind
    ("vec", jnp.bfloat16, "conv_forward", (True, True, True), False),
    ("vec-ir_mul", jnp.float16, "conv_backward", (True, True, True), True),
    ("wide", jnp.bfloat16, "conv_atomic_backward", SECOND, False),
    ("vec-ir_mul", jnp.bfloat16, "tp_forward", (True, True, True), False),
    ("uvu-in2-mul", jnp.float16, "tp_backward", (True, True, True), True),
    ("vec", jnp.bfloat16, "tp_second", SECOND, False),
]


COMPILE_PROBLEMS = {
    **PROBLEMS,
    "nequip-benzene": functools.partial(jequi.problems.get, "nequip-benzene"),
    "nequip-benzene-ir_mul": functools.partial(jequi.problems.get, "nequip-benzene", layout="ir_mul"),
}


@pytest.mark.skipif(build.toolchain_missing() is not None, reason=str(build.toolchain_missing()))
@pytest.mark.parametrize("name, dtype, kind, needs, shared", COMPILE_CASES)
def test_generated_kernels_compile(name, dtype, kind, needs, shared, tmp_path, monkeypatch):
    """nvcc compiles the generated source for sm_90 (it needs no GPU), and the kernel the
    backend keeps does not spill registers. `needs`: a backward's gradients, or the
    :class:`~jequi.sums.Sums` of a fused double backward's kernel."""
    monkeypatch.setattr(build, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(ops, "generated", {})
    sums = needs if isinstance(needs, Sums) else Sums.gradients(needs) if kind.endswith("backward") else FORWARD
    kernel = ops.kernel(COMPILE_PROBLEMS[name]().descriptor.trilinear, dtype, kind, sums, shared)
    path = build.cubin(kernel.source, "sm_90")
    assert path.read_bytes()[:4] == b"\x7fELF"
    usage = build.resources(path)
    assert usage["registers"] and usage["spill_stores"] <= build_search.spill_bytes(DEFAULT, dtype), usage


@gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_batched_forward_and_backward(name, shared, dtype):
    check_batched(PROBLEMS[name](), "cuda", BATCH, dtype, shared, TOL[dtype])


def force_training_loss(tp, backend):
    """``loss(x, y, w, g)``: force training's double-backward loss, ``|gx|^2 + |gy|^2 + |gw|^2``
    of the backward of ``<tp(x, y, w), g>`` on `backend` (its gradient runs ``dgz`` too)."""

    def loss(x, y, w, g):
        grads = jax.grad(lambda *a: jnp.vdot(tp(*a, backend=backend), g), argnums=(0, 1, 2))(x, y, w)
        return sum(jnp.sum(d**2) for d in grads)

    return loss


def _graph(rng, tp, n, e, dtype, shared=False):
    x = rng.normal(size=(n, tp.irreps_in1.dim)).astype(dtype)
    y = rng.normal(size=(e, tp.irreps_in2.dim)).astype(dtype)
    w = rng.normal(size=(tp.weight_numel,) if shared else (e, tp.weight_numel)).astype(dtype)
    return x, y, w, rng.integers(0, n, e), rng.integers(0, n, e)


# the conv backends (cuda-atomic: the backward walks receivers and adds gx with atomics)
CONV_CASES = [(name, "cuda") for name in PROBLEMS] + [(name, "cuda-atomic") for name in PROBLEMS if name != "nequix-first"]


@gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("name, backend", CONV_CASES)
def test_conv_values_and_gradients(name, backend, shared, dtype):
    _check_conv(PROBLEMS[name](), backend, shared, dtype)


def _check_conv(tp, backend, shared, dtype):
    """The conv of `tp` on `backend` against ``xla``: values and first derivatives, on a graph
    with dropped edges and a hub."""
    rng = np.random.default_rng(3)
    n, e = 150, 2500
    x, y, w, s, r = _graph(rng, tp, n, e, dtype, shared)
    s[:3], r[3:5] = [n, -1, n + 7], [n, -3]  # dropped edges
    r[10:300] = 7  # a hub with chunks of several edges
    conv = lambda b: lambda x, y, w: tp.conv(x, y, w, s, r, n, backend=b)  # noqa: E731
    assert_close(conv(backend)(x, y, w), conv("xla")(x, y, w), TOL[dtype], "forward")
    loss = lambda b: lambda x, y, w: jnp.sum(jnp.sin(conv(b)(x, y, w)))  # noqa: E731
    ours = jax.grad(loss(backend), argnums=(0, 1, 2))(x, y, w)
    for a, b, what in zip(ours, jax.grad(loss("xla"), argnums=(0, 1, 2))(x, y, w), "xyw"):
        assert_close(a, b, TOL[dtype], f"d/d{what}")
    if not shared:
        assert not np.any(np.asarray(ours[1])[:5]) and not np.any(np.asarray(ours[2])[:5])


@gpu
@pytest.mark.parametrize("backend", ["cuda", "cuda-atomic"])
@pytest.mark.parametrize("name", ["uvu", "mace-large"] if ON_GPU else [])
def test_second_and_third_order(name, backend):
    _check_higher_orders(PROBLEMS[name](), backend)


def _check_higher_orders(tp, backend):
    """The conv's second and third derivatives on `backend` against ``xla`` (float64)."""
    rng = np.random.default_rng(4)
    n, e = 60, 700
    x, y, w, s, r = _graph(rng, tp, n, e, np.float64)

    def derivatives(backend):
        conv = lambda x, y, w: tp.conv(x, y, w, s, r, n, backend=backend)  # noqa: E731
        first = lambda x, y, w: jax.grad(lambda *a: jnp.sum(jnp.sin(conv(*a))), argnums=(0, 1, 2))(x, y, w)  # noqa: E731
        second = jax.grad(lambda *a: sum(jnp.sum(g**2) for g in first(*a)), argnums=(0, 1, 2))
        third = jax.grad(lambda *a: sum(jnp.sum(jnp.cos(g)) for g in second(*a)), argnums=(0, 1))
        return (*second(x, y, w), *third(x, y, w))

    for a, b in zip(derivatives(backend), derivatives("xla")):
        assert_close(a, b, 1e-10)


@pytest.fixture
def small_code_budget(monkeypatch):
    """The names of the cuda backends with a 16 KB ``Config.code_bytes`` and
    ``batched_code_bytes`` (kernels split into several groups), by base name; ``ops.generated``
    holds only the kernels built here."""
    small = dataclasses.replace(DEFAULT, code_bytes=16 * 1024, batched_code_bytes=16 * 1024)
    monkeypatch.setattr(ops, "generated", {})
    atomic = dataclasses.replace(small, atomic_conv_backward=True)
    return {b: jequi.backends.register(jequi.backends.configured("cuda", c)) for b, c in (("cuda", small), ("cuda-atomic", atomic))}


@gpu
@pytest.mark.parametrize("backend", ["cuda", "cuda-atomic"])
@pytest.mark.slow
def test_conv_kernels_split_into_groups(backend, small_code_budget):
    """Conv kernels split into several blocks per node (a small ``Config.code_bytes``),
    group-major and (the float64 forward) node by node, against the reference in every
    derivative order."""
    tp = PROBLEMS["vec-ir_mul"]()
    for dtype in (np.float32, np.float64):
        _check_conv(tp, small_code_budget[backend], False, dtype)
    _check_higher_orders(tp, small_code_budget[backend])
    split = {(dtype, k.kind, k.group_major) for (_, dtype, *_), k in ops.generated.items() if k.groups > 1}
    assert {(np.dtype(np.float64), "conv_forward", False), (np.dtype(np.float32), "conv_forward", True)} <= split
    backward = "conv_atomic_backward" if backend == "cuda-atomic" else "conv_backward"
    assert {(np.dtype(np.float64), backward, True), (np.dtype(np.float32), backward, True)} <= split


@gpu
@pytest.mark.slow
def test_batched_backward_kernels_split_into_groups(small_code_budget):
    """Batched float32 backward kinds and the double backward's forward sum (``dgz``) whose
    code does not fit a small ``Config.batched_code_bytes`` (group-major, in narrower blocks)
    against the reference: the gradients with per-row and shared weights, under vmap, and the
    double backward with every input perturbed, fused (``tp_second``; float64's backwards run
    one program per block, group-major, at any budget)."""
    tp = PROBLEMS["vec-ir_mul"]()
    cuda = small_code_budget["cuda"]
    for shared in (False, True):
        check_batched(tp, cuda, BATCH, np.float32, shared, TOL[np.float32])
    x, y, w = random_inputs(tp, BATCH, np.float32)
    stacked = [np.stack([a, a[::-1]]) for a in (x, y, w)]
    vmapped = lambda b: jax.jit(jax.vmap(jax.grad(lambda *a: jnp.sum(jnp.sin(tp(*a, backend=b))), argnums=(0, 1, 2))))(*stacked)  # noqa: E731
    for a, b, what in zip(vmapped(cuda), vmapped("xla"), "xyw"):
        assert_close(a, b, TOL[np.float32], f"vmap d/d{what}")
    g = np.random.default_rng(3).normal(size=(BATCH, tp.irreps_out.dim)).astype(np.float32)

    def second(backend):
        return jax.jit(jax.grad(force_training_loss(tp, backend), argnums=(0, 1, 2, 3)))(x, y, w, g)

    for a, b, what in zip(second(cuda), second("xla"), ("x", "y", "w", "gz")):
        assert_close(a, b, 1e-4, f"d/d{what}")
    split = {(kind, sums, shared): k for (_, _, kind, sums, shared, _), k in ops.generated.items() if kind != "tp_forward" or sums.summed}
    assert any(shared for *_, shared in split) and len(split) >= 3
    assert "tp_second" in {kind for kind, *_ in split}
    assert all(k.groups > 1 and k.group_major for k in split.values())


@pytest.mark.skipif(build.toolchain_missing() is not None, reason=str(build.toolchain_missing()))
def test_conv_kernels_take_the_widest_blocks_whose_code_fits(monkeypatch):
    """:func:`ffi.ops.kernel` builds a conv kernel with ``Config.block_warps`` warps per block,
    then with each of ``build_search.BLOCK_WARPS``, and keeps the first build whose code fits
    ``Config.code_bytes`` (:func:`ffi.build_search.code_fits`): at 25 KB the conv kinds of a small
    product stop at four different widths, all split; without a budget the blocks keep
    ``block_warps``. The float64 forward runs node by node, the others group-major."""
    desc = PROBLEMS["vec-ir_mul"]().descriptor.trilinear
    budget = 25 * 1024
    config = dataclasses.replace(DEFAULT, code_bytes=budget)
    monkeypatch.setattr(ops, "generated", {})
    widths = set()
    for dtype in DTYPES:
        for kind in ("conv_forward", "conv_backward"):  # the atomic backward is built alike
            k = ops.kernel(desc, dtype, kind, config=config)
            sums = FORWARD if kind == "conv_forward" else BACKWARD
            builds = {w: build_search._uncapped_enough(desc, np.dtype(dtype), kind, sums, False, dataclasses.replace(config, block_warps=w))
                      for w in (config.block_warps, *build_search.BLOCK_WARPS)}  # fmt: skip
            width = next(w for w, b in builds.items() if build_search.code_fits(b, budget))
            assert k.source == builds[width].source and k.groups > 1, (kind, dtype)
            assert k.group_major == (kind != "conv_forward" or dtype == np.float32)
            assert ("blockIdx.x / nodes" in k.source) == k.group_major
            widths.add(width)
    assert len(widths) == 4
    ops.clear()
    whole = ops.kernel(desc, np.float32, "conv_backward", config=dataclasses.replace(config, code_bytes=0))
    assert whole.groups == 1 and not whole.group_major and whole.threads == schedule.LANES * sum(p.warps for p in whole.programs)


@pytest.mark.skipif(build.toolchain_missing() is not None, reason=str(build.toolchain_missing()))
def test_batched_backward_kernels_go_group_major_then_narrower():
    """A batched backward kind whose groups' code does not fit ``Config.batched_code_bytes``
    node by node runs them group-major, then in narrower blocks (:func:`ffi.build_search._narrower`),
    and so does the double backward's forward sum; the forward of one product is built as
    configured whatever its code, and no batched kind reads the conv's ``code_bytes``."""
    desc = PROBLEMS["vec-ir_mul"]().descriptor.trilinear
    sums = BACKWARD
    base = DEFAULT

    def kept(config):
        ops.clear()
        k = ops.kernel(desc, np.float32, "tp_backward", config=config)
        builds = [build_search._uncapped_enough(desc, np.dtype(np.float32), "tp_backward", sums, False, c)
                  for c in build_search._narrower(config, conv=False)]  # fmt: skip
        fits = [build_search.code_fits(b, config.batched_code_bytes) for b in builds]
        assert k.source == builds[fits.index(True)].source
        return fits.index(True), k

    try:
        # two-warp blocks: several groups, node by node all of them on two multiprocessors
        narrow = dataclasses.replace(base, block_warps=2, batched_code_bytes=0, code_bytes=1024)
        _, whole = kept(narrow)
        assert whole.groups > 1 and not whole.group_major
        group = build.code_bytes(build.cubin(whole.source)) // whole.groups
        at, k = kept(dataclasses.replace(narrow, batched_code_bytes=group + 1024))
        assert at == 1 and k.group_major and k.groups == whole.groups  # the same blocks, group-major
        # twelve-warp blocks: one group of every program; it fits only cut into groups
        at, k = kept(dataclasses.replace(base, batched_code_bytes=group + 1024))
        assert at > 1 and k.group_major and k.groups > 1
        tiny = dataclasses.replace(base, batched_code_bytes=1024)
        ops.clear()
        forward = ops.kernel(desc, np.float32, "tp_forward", config=tiny)
        assert forward.source == build_search._uncapped_enough(desc, np.dtype(np.float32), "tp_forward", FORWARD, False, tiny).source
        assert not build_search.code_fits(forward, tiny.batched_code_bytes)
        dgz = ops.kernel(desc, np.float32, "tp_forward", Sums.of((True,) * 4, (True,) * 3).of_kind(backward=False), config=tiny)
        assert dgz.group_major and dgz.groups > 1
        fused = ops.kernel(desc, np.float32, "tp_second", SECOND, config=tiny)
        assert fused.group_major and fused.groups > 1
    finally:
        ops.clear()


def test_unstaged_float32_forward_sums_take_their_own_registers():
    """``Config.unstaged_float32_forward_sum_registers`` shapes the programs of a float32
    ``ir_mul`` forward sum (the double backward's ``dgz``) and nothing else: not the forward of
    one product, not a staged (``mul_ir``) sum, not float64."""
    dgz = Sums.of((True,) * 4, (True,) * 3).of_kind(backward=False)
    few, many = (dataclasses.replace(DEFAULT, unstaged_float32_forward_sum_registers=r) for r in (64, 192))

    def kernel(layout, dtype, sums, config):
        desc = jequi.problems.get("mace-large", layout=layout).descriptor.trilinear
        return codegen.generate(desc, np.dtype(dtype), "tp_forward", sums, False, config)

    assert len(kernel("ir_mul", np.float32, dgz, few).programs) > len(kernel("ir_mul", np.float32, dgz, many).programs)
    for layout, dtype, sums in (("ir_mul", np.float32, FORWARD), ("mul_ir", np.float32, dgz), ("ir_mul", np.float64, dgz)):
        assert kernel(layout, dtype, sums, few).source == kernel(layout, dtype, sums, many).source


def test_code_fits(monkeypatch, tmp_path):
    """The code two neighbouring multiprocessors run at once: one group's (the kernel's divided
    by its groups) group-major; node by node one group per block the two hold, up to all."""
    monkeypatch.setattr(build, "cubin", lambda source: tmp_path)
    monkeypatch.setattr(build, "code_bytes", lambda path: 120)  # 30 bytes a group
    blocks = {}
    monkeypatch.setattr(build, "resident_warps", lambda path, threads, smem: blocks["n"] * threads // schedule.LANES)
    k = codegen.generate(PROBLEMS["uvu"]().descriptor.trilinear, np.float32, "conv_forward")
    four = dataclasses.replace(k, groups=4, group_major=True)
    blocks["n"] = 8
    assert build_search.code_fits(four, 30) and not build_search.code_fits(four, 29) and build_search.code_fits(four, 0)
    node_major = dataclasses.replace(four, group_major=False)
    assert build_search.code_fits(node_major, 120) and not build_search.code_fits(node_major, 119)  # all 4 groups
    blocks["n"] = 1
    assert build_search.code_fits(node_major, 60) and not build_search.code_fits(node_major, 59)  # 2 blocks, 2 groups


@pytest.mark.skipif(build.toolchain_missing() is not None, reason=str(build.toolchain_missing()))
def test_code_bytes_reads_the_executable_sections(tmp_path):
    """``build.code_bytes``: the sizes of a cubin's executable sections (SASS is 16 bytes an
    instruction); anything but a little-endian ELF64 file is refused."""
    path = build.cubin(codegen.generate(PROBLEMS["uvu"]().descriptor.trilinear, np.float32, "conv_forward").source, "sm_90")
    code = build.code_bytes(path)
    assert 0 < code < path.stat().st_size and code % 16 == 0
    (tmp_path / "x").write_bytes(b"not a cubin")
    with pytest.raises(ValueError, match="ELF64"):
        build.code_bytes(tmp_path / "x")


def test_second_order_sums_name_their_operands():
    """A fused double backward's kernels take the cotangents they read and build an ``A``
    table per ``y``-like operand; a backward of ``gy`` alone builds none."""
    desc = PROBLEMS["vec-ir_mul"]().descriptor.trilinear
    forward = codegen.generate(desc, np.float32, "conv_forward", SECOND)
    assert forward.arrays == (X, Y, W, GGX, GGY, GGW)
    assert "build_a0(warp, ggy + (long long)e * D2, Bs + lane * NA)" in forward.source
    backward = codegen.generate(desc, np.float32, "tp_backward", SECOND_BENCH)
    assert backward.arrays == (X, Y, W, GZ, GGX, GGY) and "const T* __restrict__ ggw" not in backward.source
    gy_only = codegen.generate(desc, np.float32, "tp_backward", Sums.gradients((False, True, False)))
    assert "build_a" not in gy_only.source.split("jequi_tp_backward")[1]


@pytest.mark.skipif(build.toolchain_missing() is not None, reason=str(build.toolchain_missing()))
def test_tp_second_runs_where_the_outputs_follow_x(monkeypatch):
    """The double backward's ``dgz`` runs inside its backward kernel (``tp_second``) when both
    are wanted, every output segment is reached from one
    ``x`` segment and the fused kernel spills at most ``FUSED_SPILL_BYTES``; the kernel stores
    each output segment once, after its last term, and ``tp_second`` refuses a product whose
    outputs do not follow ``x``."""
    desc, merged = (PROBLEMS[n]().descriptor.trilinear for n in ("vec-ir_mul", "merged"))
    assert schedule.outputs_follow_x(desc) and not schedule.outputs_follow_x(merged)
    fuses = lambda d, sums=SECOND: ops.fuses_second(d, np.float32, sums)  # noqa: E731
    assert fuses(desc) and not fuses(merged)
    assert not fuses(desc, SECOND.of_kind(backward=True)) and not fuses(desc, SECOND.of_kind(backward=False))
    monkeypatch.setattr(ops, "FUSED_SPILL_BYTES", -1)  # no kernel spills fewer bytes
    assert not fuses(desc)
    with pytest.raises(ValueError, match="one x segment"):
        codegen.generate(merged, np.float32, "tp_second", SECOND)
    with pytest.raises(ValueError, match="forward sum"):
        codegen.generate(desc, np.float32, "tp_second", SECOND_BENCH)
    k = codegen.generate(desc, np.float32, "tp_second", SECOND)
    assert k.arrays == (X, Y, W, GZ, GGX, GGY, GGW) and "T* __restrict__ gw, T* __restrict__ out" in k.source
    outputs = {t.out.offset for t in schedule.terms(desc)}
    stores = [line for line in k.source.splitlines() if "(out + (row0 + kk) * DOUT) + bo" in line]
    assert {int(line.split(" + bo")[1].split(" ")[0]) for line in stores} == outputs
    assert len(stores) == sum(len(ctext.lane_vectors(s, p.channels)) for p in k.programs for s in p.out_segments)


def test_atomic_conv_backward_walks_receivers():
    """The atomic conv backward reads each receiver's cotangent row once (not per edge),
    gathers each edge's sender row and adds ``gx`` to it with vector reductions; the
    deterministic one reads the cotangent row per edge and stores each sender's ``gx`` once."""
    desc = PROBLEMS["vec-ir_mul"]().descriptor.trilinear
    atomic = codegen.generate(desc, np.float32, "conv_atomic_backward").source
    plain = codegen.generate(desc, np.float32, "conv_backward").source
    assert "(gz + (long long)r * DOUT)" in atomic and "const T* gr_n = gz + " not in atomic
    assert "const T* xr_n = x + (long long)s_node[" in atomic
    assert "red_add(reinterpret_cast<T4*>((gx + (long long)s_node[kk] * D1)" in atomic and "__stcs(reinterpret_cast<T4*>((gx" not in atomic
    assert "const T* gr_n = gz + " in plain and "red_add" not in plain


@gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("name", ["uvu", "uvu-in2-mul", "wide", "vec-ir_mul", "merged", "mace-large-ir_mul"] if ON_GPU else [])
@pytest.mark.parametrize("backend", ["cuda", "cuda-atomic"])
def test_fused_double_backward_every_term(backend, name, conv, shared, dtype):
    """The VJP of the backward in all of (x, y, w, gz) with all three cotangents nonzero: the
    fused double backward's kernels over every term of the seven-op identity (``dgz`` over
    three triples, each gradient over two pairs), against the reference."""
    tp = PROBLEMS[name]()
    rng = np.random.default_rng(8)
    n, e = 50, 600
    x, y, w, s, r = _graph(rng, tp, n, e, dtype, shared)
    if conv:
        f = lambda b: lambda x, y, w: tp.conv(x, y, w, s, r, n, backend=b)  # noqa: E731
    else:
        x = rng.normal(size=(e, tp.irreps_in1.dim)).astype(dtype)
        f = lambda b: lambda x, y, w: tp(x, y, w, backend=b)  # noqa: E731
    gz = rng.normal(size=f("xla")(x, y, w).shape).astype(dtype)
    cts = [rng.normal(size=a.shape).astype(dtype) for a in (x, y, w)]

    def second(b):
        def backward(x, y, w, gz):
            return jax.vjp(f(b), x, y, w)[1](gz)

        return jax.jit(lambda *a: jax.vjp(backward, *a)[1](tuple(cts)))(x, y, w, gz)

    if backend == "cuda-atomic" and not conv:
        pytest.skip("the batched product runs the cuda backend's kernels")
    for a, b, what in zip(second(backend), second("xla"), ["dx", "dy", "dw", "dgz"]):
        assert_close(a, b, 20 * TOL[dtype], what)
    if not conv:  # dgz beside the gradients in one kernel where the outputs follow x
        desc = tp.descriptor.trilinear
        fused = any(key[0] == desc and key[2] == "tp_second" for key in ops.generated)
        assert fused == schedule.outputs_follow_x(desc)


@gpu
@pytest.mark.parametrize("backend", ["cuda", "cuda-atomic"])
def test_force_training_step_matches(backend):
    """The shape of force training: a loss on the gradient with respect to y (the
    spherical harmonics, which carry the positions), differentiated by x and w, equals the
    reference's (second order, with y unperturbed at the outer level)."""
    tp = PROBLEMS["uvu"]()
    rng = np.random.default_rng(5)
    n, e = 40, 400
    x, y, w, s, r = _graph(rng, tp, n, e, np.float64)

    def loss(backend, x, w):
        grad_y = jax.grad(lambda y: jnp.sum(tp.conv(x, y, w, s, r, n, backend=backend) ** 2))(y)
        return jnp.sum(grad_y**2)

    for a, b in zip(jax.grad(functools.partial(loss, backend), argnums=(0, 1))(x, w), jax.grad(functools.partial(loss, "xla"), argnums=(0, 1))(x, w)):
        assert_close(a, b, 1e-10)


def test_rows_per_block():
    """A batched kernel's block takes ``Config.unstaged_float32_forward_rows`` rows in a
    float32 forward that is not staged (``ir_mul``), ``batched_forward_rows`` in the other
    forwards (a float64 forward's second build ``batched_float64_forward_rows``),
    ``batched_backward_rows`` in a backward; shared weights and the conv kinds 32."""
    config = DEFAULT
    ir, mul = (PROBLEMS[n]().descriptor.trilinear for n in ("vec-ir_mul", "vec"))

    def chunk(desc, dtype, kind, shared=False):
        return codegen.generate(desc, dtype, kind, shared=shared).chunk

    assert chunk(ir, np.float32, "tp_forward") == config.unstaged_float32_forward_rows == 1
    assert chunk(mul, np.float32, "tp_forward") == chunk(ir, np.float64, "tp_forward") == config.batched_forward_rows == 2
    float64 = dataclasses.replace(config, batched_forward_rows=config.batched_float64_forward_rows)
    assert codegen.generate(ir, np.float64, "tp_forward", config=float64).chunk == config.batched_float64_forward_rows == 1
    assert chunk(ir, np.float32, "tp_backward") == chunk(mul, np.float64, "tp_backward") == config.batched_backward_rows
    assert chunk(ir, np.float32, "tp_forward", shared=True) == chunk(ir, np.float32, "conv_forward") == schedule.LANES


def test_untouched_results_start_at_zero():
    """Where no term reaches an input or output segment, the kernels do not write it: its
    result (``gx``, the output) is zeroed before the kernel runs, and only then."""
    unreached = PROBLEMS["unreached"]().descriptor.trilinear
    assert unreached.untouched[:3] == (True, False, True)
    assert ops._zeroed(unreached, (True, True, True)) == (0,) and ops._zeroed(unreached, (False, True, True)) == ()
    full = PROBLEMS["uvu"]().descriptor.trilinear
    assert full.untouched[:3] == (False, False, False) and ops._zeroed(full, (True, True, True)) == ()
    silent = jequi.TensorProduct("2x0e+2x1o", "0e", "2x0e+2x1o", [(0, 0, 0, "uvu", True), (1, 0, 1, "uvu", True, 0.0)])
    assert silent.descriptor.trilinear.untouched[:3] == (True, True, True)  # the path of weight zero reaches nothing
    assert ops._zeroed(silent.descriptor.trilinear, (False, True, True)) == (1,)
    # a path whose coefficients all fall below the kernels' zero has no terms (and no literal)
    tiny = jequi.TensorProduct("2x0e+2x1o", "0e", "2x0e+2x1o", [(0, 0, 0, "uvu", True), (1, 0, 1, "uvu", True, 1e-40)])
    assert tiny.descriptor.trilinear.untouched[:3] == (True, True, True)
    assert "None" not in codegen.generate(tiny.descriptor.trilinear, np.float32, "tp_backward").source
    alone = jequi.TensorProduct("2x1o", "0e", "2x1o", [(0, 0, 0, "uvu", True, 1e-40)])
    assert ops.unsupported_reason(alone.descriptor.trilinear) == "no path of the product has a nonzero coefficient"


def test_every_op_zeroes_the_untouched_results(monkeypatch):
    """Each op hands the results :attr:`~jequi.TensorProductDescriptor.untouched` names to the
    launcher's zero mask, numbered among the results it computes (kernels generated, not
    compiled: launches captured)."""
    launches = []

    def captured(k, args, outs, grid_x, unit, scalars, zero=()):
        launches.append(zero)
        return [jnp.zeros(o.shape, o.dtype) for o in outs] if isinstance(outs, list) else jnp.zeros(outs.shape, outs.dtype)

    monkeypatch.setattr(ops, "kernel", lambda desc, dtype, kind, sums=launch.FIRST_ORDER, shared=False, config=DEFAULT: codegen.generate(
        desc, dtype, kind, launch.computed(kind, sums), shared, config))  # fmt: skip
    monkeypatch.setattr(build, "call", captured)
    silent = jequi.TensorProduct("2x0e+2x1o", "0e", "2x0e+2x1o", [(0, 0, 0, "uvu", True), (1, 0, 1, "uvu", True, 0.0)])
    graph = jequi.Graph.build(np.array([0, 1, 2]), np.array([1, 2, 0]), 3)
    atomic = dataclasses.replace(DEFAULT, atomic_conv_backward=True)
    # the zero masks of: forward; backward; backward without gx; conv forward (the output, then
    # the extras of rows in parts); conv backward (gx, its extras, gy, gw); atomic conv backward
    # (which zeroes gx to add into it); the same without gx; tp_second (gx, gy, gw, then the
    # forward sum)
    cases = [
        (PROBLEMS["uvu"](), [(), (), (), (), (), (0,), (), ()]),
        (PROBLEMS["unreached"](), [(0,), (0,), (), (0, 1), (0, 1), (0,), (), (0, 3)]),  # the output and gx
        (silent, [(0,), (0, 2), (1,), (0, 1), (0, 1, 3), (0, 2), (1,), (0, 2, 3)]),  # the output, gx and gw
    ]
    for tp, expected in cases:
        desc = tp.descriptor.trilinear
        d1, d2, dout = desc.dims
        x, y, w, gz = (np.ones((3, d), np.float32) for d in (d1, d2, desc.weight_numel, dout))
        launches.clear()
        ops.forward(desc, x, y, w)
        ops.backward(desc, x, y, w, gz)
        ops.backward(desc, x, y, w, gz, needs=(False, True, True))
        ops.conv_forward(desc, x, y, w, graph)
        ops.conv_backward(desc, x, y, w, gz, graph)
        ops.conv_backward(desc, x, y, w, gz, graph, config=atomic)
        ops.conv_backward(desc, x, y, w, gz, graph, needs=(False, True, True), config=atomic)
        ops.second_sum(desc, (x, y, w, gz, x, y, w), SECOND)
        assert launches == expected, (tp, launches)


def test_half_precision_results_are_rounded_once(monkeypatch):
    """In bfloat16 and float16 the kernels write the results they complete in the operands'
    dtype and the partial sums their caller still adds in float32 (``Plan._result_dtypes``: a
    conv's node rows and their extras, the groups' ``gy``, a shared weight's per-block ``gw``);
    every op returns its operands' dtype. In float32 every result is float32 (kernels generated,
    not compiled: launches captured)."""
    launches = []

    def captured(k, args, outs, grid_x, unit, scalars, zero=()):
        many = isinstance(outs, list)
        launches.append((k.kind, k.groups, [np.dtype(o.dtype).name for o in (outs if many else [outs])]))
        zeros = [jnp.zeros(o.shape, o.dtype) for o in (outs if many else [outs])]
        return zeros if many else zeros[0]

    monkeypatch.setattr(ops, "kernel", lambda desc, dtype, kind, sums=launch.FIRST_ORDER, shared=False, config=DEFAULT: codegen.generate(
        desc, dtype, kind, launch.computed(kind, sums), shared, config))  # fmt: skip
    monkeypatch.setattr(build, "call", captured)
    graph = jequi.Graph.build(np.array([0, 1, 2]), np.array([1, 2, 0]), 3)
    atomic = dataclasses.replace(DEFAULT, atomic_conv_backward=True)
    for name in ("uvu", "wide"):
        desc = PROBLEMS[name]().descriptor.trilinear
        d1, d2, dout = desc.dims
        for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
            x, y, w, gz = (jnp.ones((3, d), dtype) for d in (d1, d2, desc.weight_numel, dout))
            s = np.dtype(dtype).name
            half = dtype != jnp.float32
            f = "float32"
            launches.clear()
            results = [ops.forward(desc, x, y, w), *ops.backward(desc, x, y, w, gz), *ops.backward(desc, x, y, w[0], gz),
                       ops.conv_forward(desc, x, y, w, graph), *ops.conv_backward(desc, x, y, w, gz, graph),
                       *ops.conv_backward(desc, x, y, w, gz, graph, config=atomic)]  # fmt: skip
            assert all(r.dtype == dtype for r in results), (name, s, [r.dtype for r in results])
            group_gy = lambda groups: f if half and groups > 1 else s  # noqa: E731
            (_, _, fwd), (_, g1, bwd), (_, g2, shared), (_, _, conv), (_, g3, cbwd), (_, g4, abwd) = launches
            assert fwd == [s] and bwd == [s, group_gy(g1), s] and shared == [s, group_gy(g2), f if half else s], (name, s, launches)
            assert conv == [f, f] and cbwd == [f, f, group_gy(g3), s] and abwd == [f, group_gy(g4), s], (name, s, launches)


def test_operand_prefetch():
    """A float32 batched backward with per-row weights loads each row's operands where they are
    used (``Config.batched_float32_backward_prefetch`` = 0); float64, shared weights and the
    conv load the next row's (edge's) operands early, under ``Config.prefetch``."""
    assert DEFAULT.batched_float32_backward_prefetch == 0
    desc = PROBLEMS["vec-ir_mul"]().descriptor.trilinear

    def early(dtype, kind, shared=False):
        return "if (kk + 1 < n)" in codegen.generate(desc, dtype, kind, shared=shared).source

    assert not early(np.float32, "tp_backward")
    assert early(np.float64, "tp_backward") and early(np.float32, "tp_backward", shared=True)
    assert early(np.float32, "conv_backward") and early(np.float64, "conv_backward")


def test_half_precision_prefetch_keeps_the_raw_values():
    """A half-precision conv's prefetch registers hold the loaded bfloat16 values raw (``H<n>``,
    widened where they are used, an edge later), not widened floats: the widening right after
    the load stalled the bfloat16 forward on it
    (benchmarks/results/2026-12-03-nvidia-h200-profile-conv-forward-bf16.md). float32's hold
    its own values."""
    desc = PROBLEMS["vec-ir_mul"]().descriptor.trilinear
    for kind in ("conv_forward", "conv_backward"):
        half, single = (codegen.generate(desc, np.dtype(dt), kind).source for dt in (jnp.bfloat16, np.float32))
        registers = lambda source: re.findall(r"^\s*(\w+) p(\w+);$", source, re.M)  # noqa: E731
        assert registers(half) and {t for t, _ in registers(half)} <= {"H1", "H2", "H4"}, (kind, registers(half))
        assert {t for t, _ in registers(single)} <= {"T", "T2", "T4"} and "H2" not in single, kind
        # each is taken as the math type of its width where the edge's arithmetic starts
        taken = re.findall(r"const T(\d?) (\w+) = p(\w+);", half)
        assert all(name == register for _, name, register in taken), kind
        widths = lambda pairs: collections.Counter((w.lstrip("HT") or "1", name) for w, name in pairs)  # noqa: E731
        assert widths(registers(half)) == widths([(f"T{w}", name) for w, name, _ in taken]), kind
    assert ctext.raw_holder("ldcs4(wr_n + 0 + u)", 4) == "H4"
    assert ctext.raw_holder("(lane + 32 < staged * 3 ? ldcs1(xr_n + bx0 + lane + 32) : T(0))", 1) is None


def test_batched_float32_backward_values():
    """``Config.batched_float32_backward_values`` sizes the programs of a float32 batched
    backward with per-row weights, and of no other kernel (``backward_values`` sizes those)."""
    desc = PROBLEMS["vec-ir_mul"]().descriptor.trilinear
    kernels = ((np.float32, "tp_backward", False), (np.float32, "tp_backward", True),
               (np.float64, "tp_backward", False), (np.float32, "conv_backward", False))  # fmt: skip

    def sources(**knobs):
        config = dataclasses.replace(DEFAULT, **knobs)
        return [codegen.generate(desc, np.dtype(dt), kind, shared=shared, config=config) for dt, kind, shared in kernels]

    default, small = sources(), sources(batched_float32_backward_values=32)
    assert small[0].threads > default[0].threads
    assert [k.source for k in small[1:]] == [k.source for k in default[1:]]
    fewer = sources(backward_values=32, batched_float32_backward_values=DEFAULT.batched_float32_backward_values)
    assert fewer[0].source == default[0].source and all(a.source != b.source for a, b in zip(fewer[1:], default[1:]))


def test_resident_warps(monkeypatch, tmp_path):
    """Warps one Hopper multiprocessor holds: registers rounded up to 8 per lane, a warp's
    from one of four sub-partitions of 16K; at most 64 warps, 32 blocks and 228 KB of shared
    memory (1 KB reserved per block)."""
    report = {}
    monkeypatch.setattr(build, "resources", lambda path: {"registers": report["registers"]})

    def resident(registers, threads, smem=0):
        report["registers"] = registers
        return build.resident_warps(tmp_path, threads, smem)

    assert resident(168, 384) == 12 and resident(168, 128) == 12  # NequIP-benzene's two builds
    assert resident(254, 224) == 7 and resident(128, 256) == 16  # NequIP-OAM's
    assert resident(126, 32) == 16 and resident(164, 96) == 12  # 128 and 168 registers allocated
    assert resident(32, 32) == 32 and resident(16, 1024) == 64  # the block and warp limits
    assert resident(96, 96) == 18 and resident(104, 32) == 16 and resident(176, 96) == 6  # per sub-partition
    assert resident(32, 32, smem=100 * 1024) == 2


def test_float64_forward_keeps_the_build_with_more_resident_warps(monkeypatch):
    """A float64 batched forward is built with ``Config.batched_float64_forward_registers`` and
    ``batched_float64_forward_rows`` and with the defaults; :func:`ffi.ops.kernel` keeps one
    that does not spill, then the one with more resident warps, on a tie fewer programs, then
    the first. Other kernels (and a 0 knob) build once."""
    desc = PROBLEMS["vec-ir_mul"]().descriptor.trilinear
    config = DEFAULT
    wide, default = build_search._configs(config, np.dtype(np.float64), "tp_forward")
    assert (wide.batched_forward_registers, wide.batched_forward_rows) == (
        config.batched_float64_forward_registers, config.batched_float64_forward_rows)  # fmt: skip
    assert default == config
    assert build_search._configs(config, np.dtype(np.float32), "tp_forward") == build_search._configs(config, np.dtype(np.float64), "tp_backward") == [config]
    off = dataclasses.replace(config, batched_float64_forward_registers=0)
    assert build_search._configs(off, np.dtype(np.float64), "tp_forward") == [off]

    assert wide.batched_forward_rows != default.batched_forward_rows
    rows = lambda source: int(re.search(r"constexpr int K = (\d+)", source).group(1))  # noqa: E731
    warps, spills = {}, {}
    monkeypatch.setattr(build, "cubin", lambda source, arch=None: source)
    monkeypatch.setattr(build, "resources", lambda source: {"registers": 64, "spill_stores": spills[rows(source)]})
    monkeypatch.setattr(build, "resident_warps", lambda source, threads, smem: warps[rows(source)])

    def chosen(wide_warps, default_warps, wide_spills=0):
        warps.update({wide.batched_forward_rows: wide_warps, default.batched_forward_rows: default_warps})
        spills.update({wide.batched_forward_rows: wide_spills, default.batched_forward_rows: 0})
        ops.clear()
        return ops.kernel(desc, np.float64, "tp_forward").chunk

    try:
        assert chosen(8, 16) == default.batched_forward_rows
        assert chosen(16, 8) == wide.batched_forward_rows
        assert chosen(16, 8, wide_spills=DEFAULT.float64_spill_bytes + 8) == default.batched_forward_rows
        n_wide, n_default = (len(codegen.generate(desc, np.float64, "tp_forward", config=c).programs) for c in (wide, default))
        tie = wide.batched_forward_rows if n_wide <= n_default else default.batched_forward_rows
        assert chosen(12, 12) == tie
    finally:
        ops.clear()


@gpu
def test_vmap_over_rows_and_graphs():
    tp = PROBLEMS["uvu"]()
    rng = np.random.default_rng(6)
    xs = rng.normal(size=(3, 20, tp.irreps_in1.dim))
    ys = rng.normal(size=(3, 20, tp.irreps_in2.dim))
    w_shared = rng.normal(size=(tp.weight_numel,))
    f = lambda b: jax.vmap(lambda x, y: tp(x, y, w_shared, backend=b))  # noqa: E731
    assert_close(f("cuda")(xs, ys), f("xla")(xs, ys), 1e-12)
    # force training's second order (dgz inside tp_second) over a batch of row sets
    ws, gs = rng.normal(size=(3, 20, tp.weight_numel)), rng.normal(size=(3, 20, tp.irreps_out.dim))

    def force(b):
        return jax.vmap(jax.grad(force_training_loss(tp, b), argnums=(0, 1, 2, 3)))(xs, ys, ws, gs)

    for a, b, what in zip(force("cuda"), force("xla"), ("x", "y", "w", "g")):
        assert_close(a, b, 1e-10, f"vmap force training d/d{what}")
    assert any(kind == "tp_second" for _, _, kind, *_ in ops.generated)
    n, e = 12, 50
    x = rng.normal(size=(3, n, tp.irreps_in1.dim))
    y = rng.normal(size=(3, e, tp.irreps_in2.dim))
    w = rng.normal(size=(3, e, tp.weight_numel))
    s, r = rng.integers(0, n, (3, e)), rng.integers(0, n, (3, e))
    graphs = jax.vmap(lambda s, r: jequi.Graph.build(s, r, n))(s, r)
    conv = lambda b: jax.vmap(lambda x, y, w, g: tp.conv(x, y, w, g, backend=b))  # noqa: E731
    assert_close(conv("cuda")(x, y, w, graphs), conv("xla")(x, y, w, graphs), 1e-12)
    grad = lambda b: jax.grad(lambda x, w: jnp.sum(jnp.sin(conv(b)(x, y, w, graphs))), argnums=(0, 1))  # noqa: E731
    for backend in ("cuda", "cuda-atomic"):
        for a, b in zip(grad(backend)(x, w), grad("xla")(x, w)):
            assert_close(a, b, 1e-12)


@gpu
def test_conv_is_bitwise_deterministic_and_handles_empty_rows():
    tp = PROBLEMS["uvu"]()
    rng = np.random.default_rng(7)
    n, e = 500, 20000
    x, y, w, s, r = _graph(rng, tp, n, e, np.float32)
    r[r == 3] = 4  # node 3 receives nothing
    graph = jequi.Graph.build(s, r, n)
    conv = jax.jit(lambda x, y, w: tp.conv(x, y, w, graph, backend="cuda"))
    grads = jax.jit(jax.grad(lambda x, y, w: jnp.sum(jnp.sin(tp.conv(x, y, w, graph, backend="cuda"))), argnums=(0, 1, 2)))
    runs = [[np.asarray(a) for a in (conv(x, y, w), *grads(x, y, w))] for _ in range(3)]
    assert all(np.array_equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    assert not np.any(runs[0][0][3])
    empty = tp.conv(x, y[:0], w[:0], s[:0], r[:0], n, backend="cuda")
    assert empty.shape == (n, tp.irreps_out.dim) and not np.any(np.asarray(empty))
