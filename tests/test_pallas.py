"""The Pallas kernels against the pure-JAX reference: every supported mode, per-row and shared
weights, f32 and f64, derivatives to second order (through the seven-op rule). On CPU the
kernels run in Pallas interpret mode at small sizes; on a GPU they run compiled (Triton)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, check_batched, five_path_channelwise, pallas_backend, random_inputs

import jequi
import pallas_kernels
from pallas_kernels import heuristics, row_code
from jequi.backends import configured, xla
from jequi.sums import GZ, Sums

ON_GPU = jax.default_backend() == "gpu"
BATCH = 300 if ON_GPU else 3

PROBLEMS = {
    "uvu": lambda: jequi.channelwise("3x0e+2x1o+5x2e", "0e+1o+2e", "0e+1o+2e+3o"),
    "uvu-in2-mul": lambda: jequi.TensorProduct("5x1o", "3x2e", "5x3o", [(0, 0, 0, "uvu", True)]),
    "uvw": lambda: jequi.fully_connected("3x0e+2x1o", "2x0e+1o", "5x0e+3x1o+2x1e"),
    "uuu+unweighted": lambda: jequi.TensorProduct(
        "3x1o", "3x1o", "3x0e+3x1e", [(0, 0, 0, "uuu", True), (0, 0, 1, "uuu", False)]
    ),
    "uuw": lambda: jequi.TensorProduct("3x1o", "3x1e", "5x1o", [(0, 0, 0, "uuw", True)]),
    "l6": lambda: jequi.channelwise("2x6e", "0e+1o+6e", "0e+5o+6e"),
    "uvu-ir_mul": lambda: jequi.channelwise("3x0e+2x1o+5x2e", "0e+1o+2e", "0e+1o+2e+3o", layout="ir_mul"),
    # one-channel inputs: pallas_kernels.row_blocks
    "uvw-rows": lambda: jequi.fully_connected("0e+1o+2e", "0e+1o", "3x0e+2x1o+2x1e+2x2e"),
    "uvw-rows-ir_mul": lambda: jequi.fully_connected("0e+1o+2e", "0e+1o", "3x0e+2x1o+2x1e+2x2e", layout="ir_mul"),
    # ... with an output (2x0o), an x segment (3o) and a y segment (2e) no path reaches, and a
    # path of weight zero (its gw is zero)
    "uvw-rows-sparse": lambda: jequi.TensorProduct(
        "0e+1o+3o", "0e+1o+2e", "2x0o+2x0e+1x1o", [(0, 0, 1, "uvw", True), (1, 1, 1, "uvw", True),
                                                   (0, 1, 2, "uvw", True), (1, 0, 2, "uvw", True, 0.0)]
    ),
}
if ON_GPU:
    for n in ("mace-large", "nequip-oam-main", "nequix-first", "diffdock-l2", "tetris-poly-1", "tetris-0-lin2", "tetris-1-sc"):
        PROBLEMS[n] = functools.partial(jequi.problems.get, n)
    for n in ("mace-large", "nequip-oam-main"):  # one-warp forwards (num_warps)
        PROBLEMS[n + "-ir_mul"] = functools.partial(jequi.problems.get, n, layout="ir_mul")

TOL = {np.float32: 5e-5, np.float64: 1e-11}

# A channelwise product of 5 paths (uvu: 13, up to l = 3) for the tests of how kernels split
# (groups, windows, row parts, output groups, partial gradients): interpreted kernels compile
# per path, and those tests are about the split, not the product. Three x windows of 2 channels
# (windows=4) cover 3x0e fully, partly and not at all, as uvu's do; two x segments, two
# groups of outputs at one accumulator register. On the GPU the tests run uvu.
SPLIT_UVU = PROBLEMS["uvu"] if ON_GPU else five_path_channelwise

# For these problems, in interpret mode the dtype changes only the forward's output groups
# (forward_groups) and the backward's row blocks (one at BATCH rows either way), and shared weights
# only the weights' loads and gw's sum over rows: there a mode runs per-row weights in float64 and
# shared ones in float32, and a variant of a mode (in2 multiplicity, l = 6, layout, sparsity) once.
# On the GPU every pair runs: Triton compiles each dtype's code (its fused multiply-adds among it).
CPU_CASES = {
    "uvu-in2-mul": [(True, np.float64)],
    "l6": [(False, np.float64)],
    "uvu-ir_mul": [(False, np.float32)],
    "uvw-rows-ir_mul": [(False, np.float32)],
    "uvw-rows-sparse": [(True, np.float64)],
}
FORWARD_BACKWARD_CASES = [
    (name, shared, dtype)
    for name in PROBLEMS
    for shared in (False, True)
    for dtype in (np.float32, np.float64)
    if ON_GPU or (shared, dtype) in CPU_CASES.get(name, [(False, np.float64), (True, np.float32)])
]


@pytest.mark.parametrize("name, shared, dtype", FORWARD_BACKWARD_CASES)
def test_forward_and_backward(name, shared, dtype):
    check_batched(PROBLEMS[name](), "pallas", BATCH, dtype, shared, TOL[dtype])


@pytest.mark.skipif(ON_GPU, reason="the GPU runs every dtype, and its problems' rules read it")
def test_cpu_cases_leave_out_no_dtype_rule():
    """CPU_CASES runs one dtype per mode and weights: that covers each kernel while the
    problems' backward groups and channel windows (rules that read the dtype) are the same in
    either dtype."""
    for name, make in PROBLEMS.items():
        desc = make().descriptor.trilinear
        for rule in (heuristics.backward_groups, heuristics.channel_windows):
            assert rule(desc, np.float32) == rule(desc, np.float64), (name, rule.__name__)


# On CPU uvw only: uvu's and uvw-rows' double backward (every pair, no dgz) is not fused, so it
# compiles the very backward kernel of test_fused_second_order's uvu and uvw-rows "all" cases
# (their dgz runs a separate forward kernel); uvw's "all" fuses dgz into its backward kernel, so
# this one's is its own. The rule's second order through the Pallas kernels under jax.grad is
# also test_derivatives.py::test_backward_calls_compute_only_needed_gradients[pallas].
@pytest.mark.parametrize("name", ["uvu", "uvw", "uvw-rows"] if ON_GPU else ["uvw"])
def test_double_backward(name):
    tp = PROBLEMS[name]()
    x, y, w = random_inputs(tp, BATCH)
    g = np.random.default_rng(3).normal(size=(BATCH, tp.irreps_out.dim))

    def dbl(f):
        def loss(x, y, w):
            gx, gy, gw = jax.grad(lambda *a: jnp.vdot(f(*a), g), argnums=(0, 1, 2))(x, y, w)
            return jnp.sum(gx**2) + jnp.sum(gy**2) + jnp.sum(jnp.sin(gw))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, y, w)

    for a, b in zip(dbl(functools.partial(tp, backend="pallas")), dbl(functools.partial(xla.forward, tp.descriptor))):
        assert_close(a, b, 1e-11)


@pytest.mark.parametrize("name", ["uvu", "uvw", "uuu+unweighted", "uuw"])
def test_conv(name):
    tp = PROBLEMS[name]()
    rng = np.random.default_rng(0)
    n, e = (200, 3000) if ON_GPU else (5, 11)
    x = rng.normal(size=(n, tp.irreps_in1.dim))
    y = rng.normal(size=(e, tp.irreps_in2.dim))
    w = rng.normal(size=(e, tp.weight_numel))
    s, r = rng.integers(0, n, e), rng.integers(0, n, e)
    loss = lambda b: lambda x, y, w: jnp.sum(tp.conv(x, y, w, s, r, n, backend=b) ** 2)  # noqa: E731
    grads = lambda b: jax.jit(jax.grad(loss(b), argnums=(0, 1, 2)))(x, y, w)  # noqa: E731
    for a, b in zip(grads("pallas"), grads("xla")):
        assert_close(a, b, 1e-11)


@pytest.mark.skipif(not ON_GPU, reason="GPU-sized: MACE-large's conv forward on one warp (float32) and two (float64)")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv_ir_mul_warps(dtype):
    """The conv in the ir_mul layout, 128 channels wide, where its forward runs one warp in
    float32 and two in float64 (conv.forward_warps): values and gradients as the reference."""
    tp = PROBLEMS["mace-large-ir_mul"]()
    rng = np.random.default_rng(5)
    n, e = 100, 1500
    x, y, w = (rng.normal(size=s).astype(dtype) for s in ((n, tp.irreps_in1.dim), (e, tp.irreps_in2.dim), (e, tp.weight_numel)))
    s, r = rng.integers(0, n, e), rng.integers(0, n, e)
    conv = lambda b: lambda x, y, w: tp.conv(x, y, w, s, r, n, backend=b)  # noqa: E731
    assert_close(conv("pallas")(x, y, w), conv("xla")(x, y, w), TOL[dtype], "forward")
    loss = lambda b: lambda x, y, w: jnp.sum(jnp.sin(conv(b)(x, y, w)))  # noqa: E731
    for a, b in zip(jax.grad(loss("pallas"), argnums=(0, 1, 2))(x, y, w), jax.grad(loss("xla"), argnums=(0, 1, 2))(x, y, w)):
        assert_close(a, b, TOL[dtype])


def test_conv_output_groups_and_determinism():
    """Wide outputs are split over programs (here forced to many); the result is
    the same, and bitwise the same from run to run."""
    tp = SPLIT_UVU()
    config = pallas_kernels.Config(accumulator_registers=1)
    backend = pallas_backend(accumulator_registers=1)
    desc = tp.descriptor.trilinear
    assert len(heuristics.conv_output_groups(desc, np.float32, config)) > 1
    rng = np.random.default_rng(1)
    n, e = (500, 20000) if ON_GPU else (4, 9)
    x, y, w = (rng.normal(size=s).astype(np.float32) for s in ((n, tp.irreps_in1.dim), (e, tp.irreps_in2.dim), (e, tp.weight_numel)))
    graph = jequi.Graph.build(rng.integers(0, n, e), rng.integers(0, n, e), n)
    conv = jax.jit(lambda x, y, w: tp.conv(x, y, w, graph, backend=backend))
    assert_close(conv(x, y, w), tp.conv(x, y, w, graph, backend="xla"), 5e-5)
    grads = jax.jit(jax.grad(lambda x, y, w: jnp.sum(jnp.sin(tp.conv(x, y, w, graph, backend=backend))), argnums=(0, 1, 2)))
    runs = [[np.asarray(a) for a in (conv(x, y, w), *grads(x, y, w))] for _ in range(3)]
    assert all(np.array_equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))


def _second_order_reference(f, spec, arrays):
    """The sums of `spec` by autodiff of the reference: each term of the seven-op identity is
    the gradient of ``<gz, f(x, y, w)>`` in one slot with the other two slots substituted."""
    gz = arrays[GZ]

    def slot_grad(slot, a, b):  # gradient in `slot` (0, 1, 2) with arrays a, b in the others
        def form(v):
            args = [a, b]
            args.insert(slot, v)
            return jnp.vdot(f(*args), gz)

        return jax.grad(form)(jnp.zeros_like(arrays[slot]))  # linear in that slot: any point

    total = lambda terms: functools.reduce(jnp.add, terms) if terms else None  # noqa: E731
    dgz = total([f(*(arrays[i] for i in t)) for t in spec.out])
    grads = [
        total([slot_grad(slot, arrays[a], arrays[b]) for a, b in pairs])
        for slot, pairs in enumerate(spec.pairs)
    ]
    return (*grads, dgz)


SPECS = {
    "all": Sums.of((True, True, True, True), (True, True, True)),
    "force-training": Sums.of((True, False, True, True), (False, True, True)),
    "dgz-only": Sums.of((False, False, False, True), (True, False, True)),
    "dw-only": Sums.of((False, False, True, False), (True, False, False)),
}


def pallas(config=pallas_kernels.DEFAULT):
    """The pallas backend with the kernels of `config` (its fused ``second`` and ``conv_second``)."""
    return configured("pallas", config)


# every mode with all terms, then shared weights and partial specs on a few (interpret mode is slow);
# on CPU uvu's conv on SPLIT_UVU: the conv's kernels run the row code (pallas_kernels.row_code) of
# the batched ones inside their edge loop, and the tp case runs it on uvu's 13 paths
SECOND_ORDER_CASES = [
    ("split-uvu" if name == "uvu" and op == "conv" and not ON_GPU else name, op, False, "all")
    for name in ("uvu", "uvw", "uuu+unweighted", "uuw")
    for op in ("tp", "conv")
]
# (uvu's shared weights and partial spec on SPLIT_UVU: they change the weights' loads, gw's sum over
# rows and the sums taken, not the row code of uvu's 13 paths, which the "all" tp case above runs)
SECOND_ORDER_CASES += [("split-uvu", "tp", True, "force-training"), ("uvw", "tp", True, "force-training")]
# Kahan sums change only how the edge loop adds each edge's values (conv._edge_loop), whatever the
# mode; dgz alone takes the forward kernel, not the backward one uvw's dgz joins with the others
SECOND_ORDER_CASES += [("split-uvu", "conv", True, "force-training"), ("uvw", "conv-kahan", False, "all")]
SECOND_ORDER_CASES += [("uvw", "tp", False, "dgz-only"), ("uvw", "conv", True, "dgz-only"), ("uvw", "tp", False, "dw-only")]
SECOND_ORDER_CASES += [("uvw-rows", "tp", False, "all"), ("uvw-rows-ir_mul", "tp", True, "force-training")]
SECOND_ORDER_CASES += [("uvw-rows-sparse", "tp", False, "all")]


@pytest.mark.parametrize("name, op, shared, spec", SECOND_ORDER_CASES)
def test_fused_second_order(name, op, shared, spec):
    """The fused double backward (a backward-sum kernel, with a forward-sum one for ``dgz`` or
    ``dgz`` inside it by :func:`pallas_kernels.fuses_second`'s rule) computes every
    sum of the seven-op identity, and only the wanted ones, as autodiff of the reference."""
    _check_second_order(name, op, shared, spec)


@pytest.mark.parametrize(
    "name, shared, spec, grouped",
    [("uvw", False, "all", False), ("uvw", True, "force-training", True), ("uuw", False, "all", False)],
)
def test_dgz_in_the_backward_kernel(name, shared, spec, grouped):
    """With ``Config.fused_second``, the batched double backward sums ``dgz`` in its backward
    kernel (a partial per program where the backward runs a program per x segment): the same
    sums as autodiff of the reference."""
    config = pallas_kernels.Config(fused_second=True, backward_groups=grouped)
    desc = PROBLEMS[name]().descriptor.trilinear
    spec_ = SPECS[spec]
    assert pallas_kernels.fuses_second(desc, np.float64, spec_, config=config)
    assert (len(heuristics.backward_groups(desc, np.float64, config)) > 1) == grouped
    _check_second_order(name, "tp", shared, spec, config)


def test_fuses_second_rule():
    """Where the batched double backward's ``dgz`` joins its backward kernel: by default where a
    row's outputs are few (the knob forces it either way), both wanted, no channel windows,
    partial rows no wider than a row of ``x, y, w``, and not on the row-block kernels."""
    spec = SPECS["all"]
    uvw = PROBLEMS["uvw"]().descriptor.trilinear  # 20 outputs
    diffdock = jequi.problems.get("diffdock-l1").descriptor.trilinear  # 156 outputs
    fuses = pallas_kernels.fuses_second
    assert fuses(uvw, np.float32, spec) and not fuses(diffdock, np.float32, spec)
    assert fuses(diffdock, np.float64, spec, config=pallas_kernels.Config(fused_second=True))
    assert not fuses(uvw, np.float32, spec.of_kind(backward=True)) and not fuses(uvw, np.float32, spec.of_kind(backward=False))
    assert not fuses(PROBLEMS["uvw-rows"]().descriptor.trilinear, np.float32, spec)
    # MACE-large: a program per x segment (3), each a partial of 9,216 outputs per row
    assert not fuses(jequi.problems.get("mace-large").descriptor.trilinear, np.float32, spec)
    assert not fuses(uvw, np.float32, spec, config=pallas_kernels.Config(channel_windows=2))
    assert not fuses(uvw, np.float32, spec, config=pallas_kernels.Config(fused_second=False))


def _check_second_order(name, op, shared, spec, config=pallas_kernels.DEFAULT):
    tp = SPLIT_UVU() if name == "split-uvu" else PROBLEMS[name]()
    desc = tp.descriptor.trilinear
    spec = SPECS[spec]
    rng = np.random.default_rng(8)
    n, e = (200, 3000) if ON_GPU else (4, 9)
    options = {"kahan": True} if op == "conv-kahan" else {}  # compensated on-chip sums
    rows = BATCH if op == "tp" else e
    xs = rng.normal(size=(2, rows if op == "tp" else n, desc.dims[0]))
    ys = rng.normal(size=(2, rows, desc.dims[1]))
    ws = rng.normal(size=(2, desc.weight_numel) if shared else (2, rows, desc.weight_numel))
    if op == "tp":
        gz = rng.normal(size=(rows, desc.dims[2]))
        f = functools.partial(xla.forward, desc)
        fused = lambda a: pallas(config).second(desc, spec, a)  # noqa: E731
    else:
        s, r = rng.integers(0, n, e), rng.integers(0, n, e)
        s[-1], r[-2] = n + 5, -1  # dropped edges: no contribution, zero dy and dw
        gz = rng.normal(size=(n, desc.dims[2]))
        graph = jequi.Graph.build(s, r, n)
        keep = (s < n) & (r >= 0)
        f = lambda x, y, w: jax.ops.segment_sum(  # noqa: E731
            jnp.where(keep[:, None], xla.forward(desc, x[np.where(keep, s, 0)], y, w), 0), np.where(keep, r, 0), num_segments=n
        )
        fused = lambda a: pallas(config).conv_second(desc, spec, a, graph, **options)  # noqa: E731
    arrays = (xs[0], ys[0], ws[0], gz, xs[1], ys[1], ws[1])
    # jitted: eager dispatch of interpret-mode kernels is several times slower
    ours = jax.jit(fused)(arrays)
    expected = jax.jit(lambda a: _second_order_reference(f, spec, a))(arrays)
    for a, b, what in zip(ours, expected, ("dx", "dy", "dw", "dgz")):
        assert (a is None) == (b is None), what
        if b is not None:
            assert_close(a, b, 1e-11, what)


# uu* paths share the row code of uv* paths that skips an unneeded gradient (row_code's
# _backward_path, one branch per pair of modes): on CPU uvu runs it for uvu and uuu, whose full
# backward is test_forward_and_backward's
@pytest.mark.parametrize("name", ["uvu", "uvw", "uuu+unweighted", "uvw-rows"] if ON_GPU else ["uvu", "uvw", "uvw-rows"])
def test_backward_computes_only_what_is_needed(name):
    """A backward asked for one of (gx, gy, gw) returns it (as the full backward does) and
    None for the others, for the batched product and the conv."""
    tp = SPLIT_UVU() if name == "uvu" else PROBLEMS[name]()
    desc = tp.descriptor.trilinear
    x, y, _ = random_inputs(tp, BATCH)
    rng = np.random.default_rng(4)
    w = rng.normal(size=(BATCH, desc.weight_numel))  # the kernels' view weights every path
    g = rng.normal(size=(BATCH, tp.irreps_out.dim))
    n = 3
    graph = jequi.Graph.build(np.arange(BATCH) % n, (np.arange(BATCH) * 7) % n, n)
    conv = functools.partial(pallas_kernels.conv_backward, desc, x[:n], y, w, g[:n], graph)
    for full, partial in [
        (pallas_kernels.backward(desc, x, y, w, g), lambda needs: pallas_kernels.backward(desc, x, y, w, g, needs)),
        (conv(), lambda needs: conv(needs=needs)),
    ]:
        for k in range(3):
            needs = tuple(j == k for j in range(3))
            got = partial(needs)
            assert [a is None for a in got] == [not need for need in needs]
            assert_close(got[k], full[k], 1e-12, f"gradient {k} alone")


def test_conv_fill_rule():
    """Rows are split to fill the GPU on small graphs only: the model benchmark's batch (512
    atoms, 21,504 edges, one output group, 2 warps) walks parts of at most 11 edges (4 a row); MACE-large
    on the carbon lattice (1,728 rows of 158 edges, 2 groups, 4 warps) whole rows."""
    fill_edges, graph = heuristics.fill_edges, jequi.graph
    assert graph.part_edges(512, 21504, fill_edges(21504, 1, 2)) == 11
    assert graph.part_edges(1728, 273024, fill_edges(273024, 2, 4)) == 2 * 158
    assert graph.part_edges(0, 0, fill_edges(0, 1, 1)) == graph.MIN_PART_EDGES


def _split_backward_matches(name, shared, seed, knob, split, whole, programs):
    """The batched backward with the knob `knob` of :class:`pallas_kernels.Config` set to
    `split` (``programs(desc, dtype, config)`` then lists more than one program) gives, at
    first order and in the fused second order, what it gives with `whole`."""
    tp = SPLIT_UVU() if name == "uvu" else PROBLEMS[name]()
    desc = tp.descriptor.trilinear
    rng = np.random.default_rng(seed)
    x, y, gz, ggx, ggy = (rng.normal(size=(BATCH, d)) for d in desc.dims[:2] + desc.dims[2:] + desc.dims[:2])
    w, ggw = rng.normal(size=(2, desc.weight_numel) if shared else (2, BATCH, desc.weight_numel))
    arrays = (x, y, w, gz, ggx, ggy, ggw)
    spec = SPECS["all"]
    config, other = (pallas_kernels.Config(**{knob: value}) for value in (split, whole))
    assert len(programs(desc, x.dtype, config)) > 1
    got = pallas_kernels.backward(desc, x, y, w, gz, config=config), pallas(config).second(desc, spec, arrays)
    expected = pallas_kernels.backward(desc, x, y, w, gz, config=other), pallas(other).second(desc, spec, arrays)
    for ours, ref in zip(got, expected):
        for a, b in zip(ours, ref):
            assert_close(a, b, 1e-12)


# on CPU uvu only: the groups take subsets of the paths whose row code is the mode's (uvw's split
# into groups, with shared weights, is test_dgz_in_the_backward_kernel's grouped case)
@pytest.mark.parametrize("name, shared", [("uvu", False), ("uvw", True)] if ON_GPU else [("uvu", False)])
def test_backward_groups(name, shared):
    """The batched backward with a program per x segment (partial gy summed after): first
    order and the fused second order as with one program per row."""
    _split_backward_matches(name, shared, 9, "backward_groups", True, False, heuristics.backward_groups)


@pytest.mark.parametrize("name, shared, windows", [("uvu", True, 4), ("uvw", False, 2)])
def test_backward_channel_windows(name, shared, windows):
    """The batched backward split over programs by windows of x channels (forced; partial gy
    summed after): first order and the fused second order as with one program per group."""
    _split_backward_matches(name, shared, 11, "channel_windows", windows, 1, heuristics.channel_windows)


def test_channel_windows_rule():
    """Two windows in float64 for channelwise products whose x segments all have >= 128
    channels; none for products with uu* paths."""
    windows = heuristics.channel_windows
    large = jequi.problems.get("mace-large").descriptor.trilinear
    assert windows(large, np.float64) == [(0, 64), (64, 128)]
    assert windows(large, np.float32) == [None]
    assert windows(jequi.problems.get("nequip-oam-main").descriptor.trilinear, np.float64) == [None]
    assert windows(jequi.problems.get("nequip-lips").descriptor.trilinear, np.float64) == [None]
    uvw = jequi.fully_connected("128x0e+128x1o", "0e+1o", "16x0e+16x1o").descriptor.trilinear
    assert windows(uvw, np.float64) == [None]  # measured for channelwise products only
    uuu = jequi.TensorProduct("128x0e", "128x0e", "128x0e", [(0, 0, 0, "uuu", True)]).descriptor.trilinear
    assert windows(uuu, np.float64) == [None]


@pytest.mark.parametrize(
    "name, shared, dtype, budget", [("uvu", False, np.float32, 0), ("uvw", True, np.float32, 0), ("uvu", False, np.float64, 1)]
)
def test_forward_groups(name, shared, dtype, budget):
    """The batched forward split over programs by output segments (forced: a program per
    segment in float32, groups of several in float64): the forward and the fused second
    order's ``dgz`` (two triples) as the reference. uvu's mode on SPLIT_UVU (five output
    segments: a program each, or two groups)."""
    tp = SPLIT_UVU() if name == "uvu" else PROBLEMS[name]()
    desc = tp.descriptor.trilinear
    rng = np.random.default_rng(10)
    x, y, gz, ggx, ggy = (rng.normal(size=(BATCH, d)).astype(dtype) for d in desc.dims[:2] + desc.dims[2:] + desc.dims[:2])
    w, ggw = rng.normal(size=(2, desc.weight_numel) if shared else (2, BATCH, desc.weight_numel)).astype(dtype)
    arrays = (x, y, w, gz, ggx, ggy, ggw)
    config = pallas_kernels.Config(forward_accumulators=budget)
    groups = heuristics.forward_groups(desc, dtype, config)
    assert 1 < len(groups) and (budget > 0) == (len(groups) < len(desc.out))
    assert_close(pallas_kernels.forward(desc, x, y, w, config), xla.forward(desc, x, y, w), TOL[dtype])
    spec = SPECS["dgz-only"]
    dgz = pallas(config).second(desc, spec, arrays)[3]
    # jitted: eagerly each op of the reference's gradients compiles alone
    expected = jax.jit(lambda a: _second_order_reference(functools.partial(xla.forward, desc), spec, a)[3])(arrays)
    assert_close(dgz, expected, TOL[dtype])


def test_forward_groups_rule():
    """Every float64 forward runs a program per output segment; a float32 one where its paths
    contract over channels (uvw) or a row has more than 128 outputs per thread (NequIP-benzene's
    312, not MACE-large's 71; in ir_mul, on one warp, MACE-large's 284). The conv
    forward's budget counts registers: a float64 sum takes two."""
    groups = heuristics.forward_groups
    large, benzene = (jequi.problems.get(n).descriptor.trilinear for n in ("mace-large", "nequip-benzene"))
    assert groups(large, np.float32) == [list(range(len(large.out)))]
    assert groups(large, np.float64) == [[s] for s in range(len(large.out))]
    assert groups(benzene, np.float32) == [[s] for s in range(len(benzene.out))]
    diffdock = jequi.problems.get("diffdock-l1").descriptor.trilinear  # 156 outputs, one warp
    assert groups(diffdock, np.float32) == groups(diffdock, np.float64) == [[s] for s in range(len(diffdock.out))]
    large_ir = jequi.problems.get("mace-large", layout="ir_mul").descriptor.trilinear
    assert groups(large_ir, np.float32) == [[s] for s in range(len(large_ir.out))]  # one warp: 284 per thread
    conv_groups = [heuristics.conv_output_groups(large, t) for t in (np.float32, np.float64)]
    assert [sum(conv_groups[0], []), sum(conv_groups[1], [])] == [list(range(len(large.out)))] * 2
    assert len(conv_groups[1]) > len(conv_groups[0]) > 1


WIDE = {  # warp-wide channels (gy's lane sums as tiles); 33 = 32 + 1: both widths on one position
    "uvu-wide": lambda: jequi.channelwise("32x0e+32x1o+33x2e", "0e+1o+2e", "32x0e+32x1o+33x2e"),
    **PROBLEMS,
}


def test_conv_row_parts(fresh_kernels, monkeypatch):
    """Rows walked in parts of at most 2 edges (fewer edges than some parts; a hub, isolated
    nodes, dropped out-of-range edges): values and gradients as the reference, bitwise the same
    from run to run."""
    monkeypatch.setattr(jequi.graph, "MIN_PART_EDGES", 2)
    monkeypatch.setattr(jequi.graph, "HUB_FACTOR", 0)
    tp = SPLIT_UVU()
    rng = np.random.default_rng(6)
    n, e = (300, 5000) if ON_GPU else (6, 14)
    s, r = rng.integers(0, n - 2, e), rng.integers(0, n - 2, e)
    r[: e // 2] = 0  # a hub
    s[-3:], r[-5:-3] = n + 5, -1  # dropped edges (in parts too)
    x = rng.normal(size=(n, tp.irreps_in1.dim))
    y = rng.normal(size=(e, tp.irreps_in2.dim))
    w = rng.normal(size=(e, tp.weight_numel))
    graph = jequi.Graph.build(s, r, n)
    f = lambda b: lambda x, y, w: tp.conv(x, y, w, graph, backend=b)  # noqa: E731
    assert_close(f("pallas")(x, y, w), f("xla")(x, y, w), 1e-12, "conv")
    grads = lambda b: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(b)(*a))), argnums=(0, 1, 2)))  # noqa: E731
    ours = [[np.asarray(a) for a in grads("pallas")(x, y, w)] for _ in range(2)]
    assert not np.any(ours[0][1][-5:]) and not np.any(ours[0][2][-5:])  # dropped: zero gy, gw
    for a, b, what in zip(ours[0], grads("xla")(x, y, w), "xyw"):
        assert_close(a, b, 1e-12, f"d/d{what}")
    assert all(np.array_equal(a, b) for a, b in zip(*ours))


@pytest.mark.parametrize("name, min_lanes", [("uvu-wide", 32), ("uvu-in2-mul", 1), ("uvw", 1)])
def test_lane_sums_as_tile(name, min_lanes):
    """gy's cross-lane sums taken as one tile reduction per run of positions (the default,
    warp-wide lane vectors only, and down to 1-lane vectors): the TP and conv backward as the
    reference."""
    if ON_GPU and min_lanes < pallas_kernels.DEFAULT.tile_min_lanes:
        pytest.skip("Triton's compiler crashes on joins of narrower lane vectors (see Config.tile_min_lanes)")
    backend = pallas_backend(tile_min_lanes=min_lanes)
    tp = WIDE[name]()
    x, y, w = random_inputs(tp, BATCH)
    g = np.random.default_rng(2).normal(size=(BATCH, tp.irreps_out.dim))
    # jitted: eagerly each op of the gradients compiles alone
    grads = lambda f: jax.jit(jax.grad(lambda *a: jnp.vdot(f(*a), g), argnums=(0, 1, 2)))(x, y, w)  # noqa: E731
    for a, b, what in zip(grads(functools.partial(tp, backend=backend)), grads(functools.partial(xla.forward, tp.descriptor)), "xyw"):
        assert_close(a, b, 1e-11, f"d/d{what}")
    s, r = np.arange(BATCH) % 2, np.arange(BATCH) % 3
    loss = lambda b: lambda y: jnp.sum(tp.conv(x[:2], y, w, s, r, 3, backend=b) ** 2)  # noqa: E731
    assert_close(jax.jit(jax.grad(loss(backend)))(y), jax.jit(jax.grad(loss("xla")))(y), 1e-11, "conv d/dy")


def test_warps():
    """One warp per backward program for channelwise products (gy's lane sums in shuffles),
    and per forward program in the ir_mul layout from 128 channels (the conv's at any width,
    but two for 128 channels in float64); products with uvw tiles keep the forward's warps."""
    warps = heuristics.num_warps
    mace, fc = (jequi.problems.get(n).descriptor.trilinear for n in ("mace-large", "tetris-1-lin2"))
    assert (warps(mace), warps(mace, backward=True)) == (4, 1)
    assert warps(fc, backward=True) == warps(fc) == 4
    mace_ir, fc_ir = (jequi.problems.get(n, layout="ir_mul").descriptor.trilinear for n in ("mace-large", "tetris-1-lin2"))
    assert (warps(mace_ir), warps(mace_ir, backward=True)) == (1, 1)
    assert warps(fc_ir) == 4
    conv_warps = heuristics.conv_forward_warps
    assert [conv_warps(d, t) for d in (mace, mace_ir) for t in (np.float32, np.float64)] == [4, 4, 1, 2]
    lips_ir, benzene_ir = (jequi.problems.get(n, layout="ir_mul").descriptor.trilinear for n in ("nequip-lips", "nequip-benzene"))
    assert warps(lips_ir) == conv_warps(lips_ir, np.float64) == 1
    # 64 channels: the batched forward keeps the width rule, the conv's runs one warp
    assert (warps(benzene_ir), conv_warps(benzene_ir, np.float32), conv_warps(benzene_ir, np.float64)) == (2, 1, 1)


@pytest.mark.parametrize("cuda", [False, True])
def test_default_backend(monkeypatch, cuda):
    """xla on CPU; on GPU pallas for every product it runs, but xla for shared weights that a
    uvw path contracts over several x channels (a weight matrix per path); where the cuda
    kernels are available, a conv at least a warp of channels wide whose backward footprint is
    small on them (the model step's products: NequIP-OAM-L's, MACE's), and a
    batched channelwise product with per-row weights on cuda (either layout), wide backwards
    too."""
    desc = lambda name: jequi.problems.get(name).descriptor.trilinear  # noqa: E731
    unsupported = jequi.TensorProduct("3x1o", "2x1o", "2x2e", [(0, 0, 0, "uvv", True)]).descriptor.trilinear
    if not ON_GPU:
        assert jequi.default_backend() == jequi.default_backend(desc("mace-large"), conv=True) == "xla"
    monkeypatch.setattr(jequi.backends.jax, "default_backend", lambda: "gpu")
    cuda_backend = jequi.backends.BACKENDS["cuda"]
    monkeypatch.setitem(jequi.backends.BACKENDS, "cuda", dataclasses.replace(cuda_backend, available=lambda: cuda))
    assert jequi.default_backend() == "pallas"
    for shared in (False, True):
        for name in ("mace-large", "nequip-oam-main", "nequip-oam-first"):
            assert jequi.default_backend(desc(name), shared, conv=True) == ("cuda" if cuda else "pallas"), name
    narrow = jequi.channelwise("16x0e+16x1o", "0e+1o", "16x0e+16x1o").descriptor.trilinear
    assert jequi.default_backend(narrow, conv=True) == "pallas"  # lanes idle below a warp of channels
    for name in ("nequip-benzene", "diffdock-l1"):  # spills, uvw
        assert jequi.default_backend(desc(name), conv=True) == "pallas", name
    assert jequi.default_backend(unsupported) == "xla"
    for name in ("mace-large", "nequip-oam-main", "nequip-lips", "nequip-benzene", "sevennet-main"):  # the batched product, per-row weights
        assert jequi.default_backend(desc(name)) == ("cuda" if cuda else "pallas"), name
        ir_mul = jequi.problems.get(name, layout="ir_mul").descriptor.trilinear
        assert jequi.default_backend(ir_mul) == ("cuda" if cuda else "pallas"), name
    for name, shared in [("mace-large", True), ("nequip-benzene", True), ("diffdock-l1", False), ("tetris-poly-1", True)]:
        assert jequi.default_backend(desc(name), shared) == "pallas", (name, shared)
    for name in ("diffdock-l1", "tetris-poly-2", "tetris-1-lin2"):
        assert jequi.default_backend(desc(name), shared_weights=True) == "xla", name


def test_row_blocks_rule():
    """Products whose x and y segments all have one channel, every path uvw, run on the
    row-block kernels; any wider input or other mode on the per-row ones."""
    applies = pallas_kernels.row_blocks.applies
    assert applies(PROBLEMS["uvw-rows"]().descriptor.trilinear)
    assert applies(jequi.problems.get("tetris-poly-1").descriptor.trilinear)
    for name in ("tetris-poly-2", "diffdock-l1", "mace-large"):
        assert not applies(jequi.problems.get(name).descriptor.trilinear), name
    assert not applies(jequi.fully_connected("2x0e+1o", "0e+1o", "3x0e+2x1o").descriptor.trilinear)
    assert not applies(jequi.channelwise("0e+1o", "0e+1o", "0e+1o").descriptor.trilinear)
    assert pallas_kernels.ops.kernels_for(PROBLEMS["uvw-rows"]().descriptor.trilinear) is pallas_kernels.row_blocks


@pytest.mark.parametrize("shared", [False, True])
def test_row_blocks_tail_rows(shared):
    """Several programs and a last block past the batch's end (its rows clamped onto the last
    one, per-row gw stored twice before the shared-weight sum): values, gradients and the fused
    second order as the reference."""
    config = pallas_kernels.Config(block_forward_rows=4, block_backward_rows=2)
    tp = PROBLEMS["uvw-rows"]()
    check_batched(tp, pallas_backend(block_forward_rows=4, block_backward_rows=2), 7, np.float64, shared, 1e-12)
    desc = tp.descriptor.trilinear
    rng = np.random.default_rng(12)
    x, y, gz, ggx, ggy = (rng.normal(size=(7, d)) for d in desc.dims[:2] + desc.dims[2:] + desc.dims[:2])
    w, ggw = rng.normal(size=(2, desc.weight_numel) if shared else (2, 7, desc.weight_numel))
    arrays = (x, y, w, gz, ggx, ggy, ggw)
    # jitted: eagerly each op of the reference's gradients compiles alone
    expected = jax.jit(lambda a: _second_order_reference(functools.partial(xla.forward, desc), SPECS["all"], a))(arrays)
    for a, b in zip(jax.jit(lambda a: pallas(config).second(desc, SPECS["all"], a))(arrays), expected):
        assert_close(a, b, 1e-12)


def test_rows_per_program_tail():
    """The per-row kernels with several rows per program and a partial last program (one
    product: the rows loop, :func:`pallas_kernels.row_code.rows_loop`, wraps every mode's row
    code alike; uvw's row code is test_forward_and_backward's). On CPU a 5-path product, not
    uvu-ir_mul's 13 paths: interpreted kernels compile per path."""
    tp = PROBLEMS["uvu-ir_mul"]() if ON_GPU else five_path_channelwise("ir_mul")
    check_batched(tp, pallas_backend(rows_per_program=2), 5, np.float64, False, 1e-12)


def test_lane_tile_sum_order():
    vectors = [jnp.asarray(np.random.default_rng(k).normal(size=32)) for k in range(16)]
    for n in (1, 2, 4, 16):
        got = row_code.lane_tile_sum(vectors[:n])
        np.testing.assert_allclose(got, [v.sum() for v in vectors[:n]], rtol=1e-12)


def test_unsupported_mode_is_a_clear_error():
    tp = jequi.TensorProduct("3x1o", "2x1o", "2x2e", [(0, 0, 0, "uvv", True)])
    x, y, w = random_inputs(tp, 2)
    with pytest.raises(ValueError, match="pallas backend does not run mode"):
        tp(x, y, w, backend="pallas")
    assert "uvv" not in pallas_kernels.SUPPORTED_MODES


def test_rows_and_warps_rules():
    """Eight rows per program for channelwise products from 8,192 rows (two for a one-warp
    forward in ir_mul), else one. The batched kernels of uvw products whose (u, w) tiles hold
    at most ONE_WARP_TILE values run one warp, wider ones (and the conv, and products with uvu
    paths too) the width rule."""
    tpk = heuristics
    desc = lambda name: jequi.problems.get(name).descriptor.trilinear  # noqa: E731
    assert tpk.rows_per_program(desc("mace-large"), 50000) == 8
    assert tpk.rows_per_program(desc("mace-large"), 100) == 1
    assert tpk.rows_per_program(desc("diffdock-l1"), 50000) == 1
    ir_mul = lambda name: jequi.problems.get(name, layout="ir_mul").descriptor.trilinear  # noqa: E731
    for name in ("mace-large", "nequip-oam-main", "nequip-lips"):  # one-warp forwards in ir_mul
        assert tpk.rows_per_program(ir_mul(name), 50000, forward=True) == 2
        assert tpk.rows_per_program(ir_mul(name), 50000) == 8
    assert tpk.rows_per_program(ir_mul("nequip-benzene"), 50000, forward=True) == 8  # two warps
    assert tpk.largest_tile(desc("tetris-poly-2")) == 64 * 4 and tpk.largest_tile(desc("mace-large")) == 0
    mixed = jequi.TensorProduct(
        "128x0e+1x1o", "0e+1o", "128x0e+2x1o", [(0, 0, 0, "uvu", True), (1, 0, 1, "uvw", True)]
    ).descriptor.trilinear
    for backward in (False, True):
        assert tpk.batched_warps(desc("tetris-poly-2"), backward=backward) == 1  # widest chunk 64: two by the width rule
        assert tpk.num_warps(desc("tetris-poly-2"), backward=backward) == 2  # the conv's
        assert tpk.batched_warps(desc("tetris-1-lin2"), backward=backward) == 4
        assert tpk.batched_warps(mixed, backward=backward) == tpk.num_warps(mixed, backward=backward)


def test_backward_groups_rule():
    """Channelwise products get a backward program per x segment; uvw ones in float64 only,
    and only with x segments of at least 8 channels."""
    groups = heuristics.backward_groups
    uvw_wide = jequi.fully_connected("16x0e+8x1o", "0e+1o", "8x0e+8x1o").descriptor.trilinear
    uvw_narrow = PROBLEMS["uvw"]().descriptor.trilinear
    assert len(groups(PROBLEMS["uvu"]().descriptor.trilinear, np.float32)) == 3
    assert len(groups(uvw_wide, np.float32)) == 1
    assert len(groups(uvw_wide, np.float64)) == 2
    assert len(groups(uvw_narrow, np.float64)) == 1


def test_chunks_cover_any_multiplicity():
    for mul in (1, 2, 10, 48, 89, 128, 250, 300):
        pieces = row_code.chunks(mul)
        assert sum(size for _, size in pieces) == mul
        assert all(size & (size - 1) == 0 and size <= 128 for _, size in pieces)


@pytest.mark.skipif(not ON_GPU, reason="the fused instruction is emitted on the GPU only")
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_multiply_add_rounds_once(dtype, fused):
    """``lowering.fma`` inside a kernel rounds once (the fused instruction), or twice inside
    ``multiply_adds(False)``. With ``a = 1 + e`` and ``c = -(1 + 2e)``, ``a * a + c`` is
    exactly ``e^2``, below half an ulp of the product, which rounding it first loses."""
    e = 2.0 ** -(np.finfo(dtype).nmant // 2 + 2)
    a = jnp.full((32,), 1 + e, dtype)
    c = jnp.full((32,), -(1 + 2 * e), dtype)

    def kernel(a_ref, c_ref, o_ref):
        with pallas_kernels.lowering.multiply_adds(fused):
            o_ref[...] = pallas_kernels.lowering.fma(a_ref[...], a_ref[...], c_ref[...])

    out = pallas_kernels.lowering.pallas_call(kernel, jax.ShapeDtypeStruct((32,), dtype), (1,), 1)(a, c)
    np.testing.assert_array_equal(out, np.full(32, e * e if fused else 0, dtype))
