"""tp.conv (every backend; Pallas in interpret mode on CPU) against gather + e3nn-jax tensor
product + segment_sum, and the Graph it runs on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, e3nn_tp, five_path_channelwise, pallas_backend

import jequi
import pallas_kernels.conv
from pallas_kernels import heuristics


def reference(tp, x, y, w, s, r, n):
    valid = (s >= 0) & (s < x.shape[0]) & (r >= 0) & (r < n)
    s, r, y = s[valid], r[valid], y[valid]
    w = w if w.ndim == 1 else w[valid]
    if len(s) == 0:
        return np.zeros((n, tp.irreps_out.dim))
    return np.asarray(jax.ops.segment_sum(e3nn_tp(tp, x[s], y, w), r, num_segments=n))


def graph(rng, tp, n, e, shared=False):
    x = rng.normal(size=(n, tp.irreps_in1.dim))
    y = rng.normal(size=(e, tp.irreps_in2.dim))
    w = rng.normal(size=(tp.weight_numel,) if shared else (e, tp.weight_numel))
    return x, y, w, rng.integers(0, n, e), rng.integers(0, n, e)


@pytest.fixture(scope="module")
def tp():
    return jequi.problems.get("nequip-water")


BACKENDS = ["xla", "pallas"] + (["cuda", "cuda-atomic"] if "cuda" in jequi.available_backends() else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("order", ["unsorted", "sorted"])
def test_conv_matches_reference(tp, order, shared, backend):
    rng = np.random.default_rng(0)
    x, y, w, s, r = graph(rng, tp, 7, 30, shared)
    if order == "sorted":
        perm = np.argsort(r, kind="stable")
        s, r, y = s[perm], r[perm], y[perm]
        w = w if shared else w[perm]
    conv = jax.jit(lambda *a: tp.conv(*a, 7, backend=backend))
    assert_close(conv(x, y, w, s, r), reference(tp, x, y, w, s, r, 7), 1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_isolated_nodes_hub_and_empty_graph(tp, backend):
    rng = np.random.default_rng(1)
    x, y, w, s, _ = graph(rng, tp, 9, 40)
    r = np.full(40, 4)  # one hub receives every edge; every other node is isolated
    s[:5] = 2  # and one node sends several edges
    out = tp.conv(x, y, w, s, r, 9, backend=backend)
    assert_close(out, reference(tp, x, y, w, s, r, 9), 1e-12)
    assert np.all(np.asarray(out)[np.arange(9) != 4] == 0)
    gx = jax.grad(lambda x: jnp.sum(tp.conv(x, y, w, s, r, 9, backend=backend) ** 2))(x)
    # the oracle's gradient: e3nn-jax's product of the gathered senders, summed into the receivers
    ref_gx = jax.grad(lambda x: jnp.sum(jax.ops.segment_sum(e3nn_tp(tp, x[s], y, w), r, num_segments=9) ** 2))(x)
    assert_close(gx, ref_gx, 1e-12)
    empty = tp.conv(x, y[:0], w[:0], s[:0], r[:0], 9, backend=backend)
    assert empty.shape == (9, tp.irreps_out.dim) and not np.any(np.asarray(empty))


@pytest.mark.parametrize("most", [1, 3, 8])
def test_row_parts(most):
    """Rows cut into parts of at most `most` edges, under jit: every row's edges covered once, in
    order, by its parts; first parts at their row's slot, the others at distinct extra slots;
    empty parts past the last real one."""
    rng = np.random.default_rng(most)
    counts = rng.integers(0, 6, 12)
    counts[[0, 5]] = [0, 23]  # an empty row and a hub
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    num_edges = int(offsets[-1]) + 4  # 4 edges past the last row: not walked
    parts = jax.jit(jequi.graph.row_parts, static_argnums=(1, 2))(offsets, num_edges, most)
    off, rows, slots, firsts = (np.asarray(a) for a in (parts.offsets, parts.rows, parts.slots, parts.firsts))
    assert parts.num_rows == 12 and parts.num_parts == 12 + num_edges // most
    assert np.all(np.diff(off) >= 0) and np.all(np.diff(off) <= most) and off[-1] == offsets[-1]
    expected = np.maximum(1, -(-counts // most))
    assert np.array_equal(np.diff(firsts), expected)
    for r in range(12):
        mine = np.arange(firsts[r], firsts[r + 1])
        assert np.all(rows[mine] == r) and off[mine[0]] == offsets[r] and off[mine[-1] + 1] == offsets[r + 1]
        assert slots[mine[0]] == r and np.array_equal(slots[mine[1:]], 12 + np.arange(firsts[r] - r, firsts[r + 1] - r - 1))
    empty = np.arange(firsts[-1], parts.num_parts)
    assert np.all(off[empty] == off[-1]) and np.all(slots[empty] >= 12)
    assert len(set(slots.tolist())) == parts.num_parts and slots.max() < 12 + max(1, parts.num_extras)


def test_add_extras_kernel():
    """The fixup that adds the partial sums of rows walked in parts: the Pallas kernel (in place,
    columns in blocks; interpreted here) and the CPU path give each row plus its extras, in
    part order, and leave rows of one part untouched."""
    rng = np.random.default_rng(3)
    counts = np.array([0, 3, 30, 1, 9, 0, 17])
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    parts = jequi.graph.row_parts(offsets, int(offsets[-1]) + 2, 4)
    d = 1100  # more than one block of columns (FIXUP_PIECES pieces of 128), a tail piece
    out = rng.normal(size=(7, d)).astype(np.float32)
    extras = rng.normal(size=(parts.num_extras, d)).astype(np.float32)
    firsts = np.asarray(parts.firsts)
    want = out.copy()
    for r in range(7):
        for k in range(firsts[r] - r, firsts[r + 1] - r - 1):
            want[r] += extras[k]
    for fn in (jequi.row_fixup.add_extras_kernel, jequi.row_fixup.add_extras):
        got = np.asarray(jax.jit(fn)(out, extras, parts.firsts))
        assert np.allclose(got, want, rtol=1e-6, atol=1e-5)
        single = np.diff(firsts) == 1
        assert np.array_equal(got[single], out[single])


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_indices_are_dropped(tp, backend):
    rng = np.random.default_rng(2)
    x, y, w, s, r = graph(rng, tp, 6, 20)
    s[[0, 5]] = [-1, 6]
    r[[1, 7, 9]] = [6, -2, 1000]
    out = jax.jit(lambda *a: tp.conv(*a, 6, backend=backend))(x, y, w, s, r)
    assert_close(out, reference(tp, x, y, w, s, r, 6), 1e-12)
    gx, gy, gw = jax.grad(lambda *a: tp.conv(*a, s, r, 6, backend=backend).sum(), argnums=(0, 1, 2))(x, y, w)
    assert np.all(np.isfinite(gx))
    dropped = [0, 1, 5, 7, 9]
    assert not np.any(np.asarray(gy)[dropped]) and not np.any(np.asarray(gw)[dropped])


def test_bipartite_num_nodes(tp):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(5, tp.irreps_in1.dim))
    y = rng.normal(size=(12, tp.irreps_in2.dim))
    w = rng.normal(size=(12, tp.weight_numel))
    s, r = rng.integers(0, 5, 12), rng.integers(0, 3, 12)
    assert_close(tp.conv(x, y, w, s, r, 3), reference(tp, x, y, w, s, r, 3), 1e-12)


def test_graph_is_built_once_and_reused(tp):
    rng = np.random.default_rng(5)
    x, y, w, s, r = graph(rng, tp, 8, 30)
    g = jax.jit(jequi.Graph.build, static_argnums=2)(s, r, 8)
    order = np.asarray(g.receiver_order)
    assert np.all(np.diff(r[order]) >= 0)  # receiver-sorted (stable)
    assert np.array_equal(np.asarray(g.receiver_offsets), np.searchsorted(r[order], np.arange(9)))
    assert np.all(np.diff(s[np.asarray(g.sender_order)]) >= 0)
    for backend in BACKENDS:
        assert_close(tp.conv(x, y, w, g, backend=backend), reference(tp, x, y, w, s, r, 8), 1e-12)
    with pytest.raises(TypeError, match="either a Graph"):
        tp.conv(x, y, w, g, r)
    with pytest.raises(ValueError, match="8 senders but x has 7 rows"):
        tp.conv(x[:7], y, w, g)
    with pytest.raises(ValueError, match="30 edges but y has 29"):
        tp.conv(x, y[:29], w[:29], g)
    with pytest.raises(ValueError, match="shifts must have shape"):
        jequi.Graph.build(s, r, 8, shifts=np.zeros((3, 3)))


def test_kahan_summation_on_a_hub():
    """f32 sums over a node with many edges: compensated sums are closer to the f64 result."""
    tp = jequi.channelwise("32x0e", "0e", "0e")
    rng = np.random.default_rng(6)
    e = 2000
    x = rng.normal(size=(1, 32)) + 3.0
    y = rng.normal(size=(e, 1)) * 10.0 ** rng.uniform(-3, 3, (e, 1))
    w = rng.normal(size=(e, tp.weight_numel))
    s, r = np.zeros(e, np.int32), np.zeros(e, np.int32)
    exact = np.asarray(tp.conv(x, y, w, s, r, 1, backend="xla"))
    f32 = [a.astype(np.float32) for a in (x, y, w)]
    plain = np.asarray(tp.conv(*f32, s, r, 1, backend="pallas"), np.float64)
    kahan = np.asarray(tp.conv(*f32, s, r, 1, backend="pallas", kahan=True), np.float64)
    inputs_only = np.asarray(tp.conv(*(a.astype(np.float64) for a in f32), s, r, 1, backend="xla"))
    err = lambda a: np.abs(a - inputs_only).max() / np.abs(exact).max()  # noqa: E731
    assert err(kahan) < 0.5 * err(plain), (err(kahan), err(plain))
    with pytest.raises(ValueError, match="kahan=True needs"):
        tp.conv(*f32, s, r, 1, backend="xla", kahan=True)


# mul_ir (the cotangent read from an ir_mul copy) is tests/test_pallas.py::test_conv[uvu]: a
# channelwise mul_ir product's conv backward, the same generated code
@pytest.mark.parametrize("layout", ["ir_mul"])
def test_backward_reads_the_cotangent_in_either_layout(layout):
    """The Pallas backward reads the output cotangent in COTANGENT_LAYOUT (a copy, or the
    array itself where the layouts agree) whatever the product's own layout; gradients match
    the XLA backend's."""
    tp = five_path_channelwise(layout)
    rng = np.random.default_rng(3)
    x, y, w, s, r = graph(rng, tp, 6, 25)
    loss = lambda b: lambda x, y, w: jnp.sum(jnp.sin(tp.conv(x, y, w, s, r, 6, backend=b)))  # noqa: E731
    grads = lambda b: jax.jit(jax.grad(loss(b), (0, 1, 2)))(x, y, w)  # noqa: E731 (eagerly each op compiles alone)
    for a, b in zip(grads("pallas"), grads("xla")):
        assert_close(a, b, 1e-12)


# the double backward's conv kernels split into programs and partials as the backward's do
# (backward_programs, row parts): second derivatives in the case with rows in parts
@pytest.mark.parametrize("chunks, part, shared, second_order", [(3, 16, False, False), (2, 3, True, True)])
def test_backward_in_chunks_of_paths(chunks, part, shared, second_order, fresh_kernels, monkeypatch):
    """Backward programs that each take a chunk of an x segment's paths (partial gx per chunk
    and row part, a partial gy per program; groups with fewer chunks zero the partials they
    lack) give the XLA backend's first (and second) derivatives; dropped edges too."""
    backend = pallas_backend(backward_chunks=chunks)
    monkeypatch.setattr(jequi.graph, "MIN_PART_EDGES", part)
    monkeypatch.setattr(jequi.graph, "HUB_FACTOR", 0)
    # 5 paths (interpreted kernels compile per path): x segment 1o's chunks hold 2 paths and 1
    # (chunks=2) or 1, 1, 1 (chunks=3, where 0e's group has 2 chunks of 3 partials)
    tp = jequi.channelwise("2x0e+2x1o", "0e+1o", "0e+1o+1e")
    programs, partials = heuristics.conv_backward_programs(tp.descriptor.trilinear, pallas_kernels.Config(backward_chunks=chunks))
    assert partials == chunks and (chunks == 2 or min(n for *_, n in programs) < partials)
    rng = np.random.default_rng(4)
    x, y, w, s, r = graph(rng, tp, 6, 25, shared)
    r[3] = 6  # out of range: dropped

    def loss(b):
        return lambda x, y, w: jnp.sum(jnp.sin(tp.conv(x, y, w, s, r, 6, backend=b)))

    def second(b):
        return lambda x, y, w: sum(jnp.sum(g**2) for g in jax.grad(loss(b), (0, 1, 2))(x, y, w))

    for f in (loss, second) if second_order else (loss,):
        for a, b in zip(jax.jit(jax.grad(f(backend), (0, 1, 2)))(x, y, w), jax.jit(jax.grad(f("xla"), (0, 1, 2)))(x, y, w)):
            assert_close(a, b, 1e-11)


def test_backward_programs_rule():
    """Each x segment's paths go to chunks by the size of their output cotangent (non-empty,
    about equal, every path once); narrow products keep one program per x segment."""
    large = jequi.problems.get("mace-large").descriptor.trilinear
    groups = heuristics.input_groups(large)
    water = jequi.problems.get("nequip-water").descriptor.trilinear
    assert heuristics.conv_backward_programs(water) == ([(s, p, 0, 1) for s, p in heuristics.input_groups(water)], 1)
    programs, partials = heuristics.conv_backward_programs(large)
    assert sorted(p.index for _, paths, *_ in programs for p in paths) == sorted(p.index for p in large.active_paths)
    size = lambda paths: sum(large.out[o].size for o in {p.i_out for p in paths})  # noqa: E731
    budget = 32 * heuristics.COTANGENT_PER_THREAD  # one warp per backward program
    for segments, paths in groups:
        chunks = [chunk for s, chunk, *_ in programs if s == segments]
        assert [c for s, _, c, _ in programs if s == segments] == list(range(len(chunks)))
        assert 1 <= len(chunks) <= -(-size(paths) // budget) and all(chunks)
        largest = max(large.out[p.i_out].size for p in paths)
        assert all(size(chunk) <= size(paths) / len(chunks) + largest for chunk in chunks)
    assert partials == max(n for *_, n in programs) > 1


@pytest.mark.parametrize("chained", [True, False])
def test_sorted_edges_and_chained_forward(tp, chained):
    """Edges given in receiver order are read in sequence (Graph.edges_sorted); the Pallas
    edge loop gives the same sums with the forward's multiply-adds started from the running
    sums or not (``Config.chained_forward``)."""
    backend = pallas_backend(chained_forward=chained)
    rng = np.random.default_rng(7)
    x, y, w, s, r = graph(rng, tp, 7, 31)
    perm = np.argsort(r, kind="stable")
    s, r, y, w = s[perm], r[perm], y[perm], w[perm]
    g = jequi.Graph.build(s, r, 7)
    assert g.edges_sorted and not jequi.Graph.build(s[::-1], r[::-1], 7).edges_sorted
    assert not jax.jit(jequi.Graph.build, static_argnums=2)(s, r, 7).edges_sorted  # traced: unknown
    loss = lambda b: lambda x, y, w: jnp.sum(jnp.sin(tp.conv(x, y, w, g, backend=b)))  # noqa: E731
    assert_close(tp.conv(x, y, w, g, backend=backend), reference(tp, x, y, w, s, r, 7), 1e-12)
    if not chained:  # the backward's kernels read neither knob: its gradients would run the chained case's kernels
        return
    grads = lambda b: jax.jit(jax.grad(loss(b), (0, 1, 2)))(x, y, w)  # noqa: E731 (eagerly each op compiles alone)
    for a, b in zip(grads(backend), grads("xla")):
        assert_close(a, b, 1e-12)


# Interpreted Pallas (the CPU) runs the sorted case only: one chunk is tp.conv itself, and the
# padded edges' chunks differ from the sorted ones' in the chunking (the backend's the same
# scan of checkpointed convs), which xla runs, and in the kernels' dropped edges, which
# test_conv_row_parts and test_pallas.py's conv second orders run; the sorted chunks keep
# Graph.edges_sorted, which only the Pallas kernels read.
RADIAL_CASES = [
    (b, chunks, edges)
    for b in BACKENDS
    for chunks, edges in [(1, "padded"), (4, "padded"), (3, "sorted")]
    if not (b == "pallas" and edges == "padded" and jax.default_backend() == "cpu")
]


@pytest.fixture(scope="module")
def radial_tp():
    """A channelwise product of 5 paths for radial_conv's tests: they test the edge chunks and
    the kernel's derivatives, not the product, and interpreted kernels compile per path."""
    return jequi.channelwise("3x0e+4x1o", "0e+1o", "0e+1o+1e")


@pytest.mark.parametrize("backend, chunks, edges", RADIAL_CASES)
def test_radial_conv_equals_conv_of_the_weights(radial_tp, backend, chunks, edges):
    """radial_conv(x, y, h, K) = conv(x, y, h @ K): values, first and second derivatives (a
    force-training loss), with padding edges or in receiver order (the chunks keep that order),
    the edges split into chunks that do not divide E."""
    tp = radial_tp
    rng = np.random.default_rng(4)
    n, e, hid = 6, 23, 5
    x, y, _, s, r = graph(rng, tp, n, e)
    if edges == "padded":
        r[[3, 11]] = -1
    else:
        r = np.sort(r)
    h = rng.normal(size=(e, hid))
    k = rng.normal(size=(hid, tp.weight_numel)) / hid
    g = jequi.Graph.build(s, r, n)
    assert g.edges_sorted == (edges == "sorted")
    seed = rng.normal(size=(n, tp.irreps_out.dim))

    def loss(fn, x, y, h, k):
        return jnp.sum(seed * fn(x, y, h, k) ** 2)

    def radial(x, y, h, k):
        return tp.radial_conv(x, y, h, k, g, edge_chunks=chunks, backend=backend)

    def plain(x, y, h, k):
        return tp.conv(x, y, h @ k, g, backend="xla")

    def force_loss(fn, x, y, h, k):  # a loss on the gradient in y and h, as force training has
        gy, gh = jax.grad(loss, argnums=(2, 3))(fn, x, y, h, k)
        return jnp.sum(gy**2) + jnp.sum(jnp.sin(gh))

    # jitted, the references too: eagerly every op of their derivatives compiles on its own
    assert_close(jax.jit(radial)(x, y, h, k), jax.jit(plain)(x, y, h, k), 1e-12, "values")
    for order, f in (("first", loss), ("second", force_loss)):
        got = jax.jit(jax.grad(lambda *a: f(radial, *a), argnums=(0, 1, 2, 3)))(x, y, h, k)
        want = jax.jit(jax.grad(lambda *a: f(plain, *a), argnums=(0, 1, 2, 3)))(x, y, h, k)
        for name, a, b in zip("xyhk", got, want):
            assert_close(a, b, 1e-10, f"{order}-order gradient in {name}")


def test_edge_chunk_values_follow_the_device_memory(monkeypatch):
    """An eighth of the device's memory in weights of the dtype; 2**30 values where the device
    reports no limit (the CPU)."""
    monkeypatch.setattr(jequi.products, "_bytes_limit", lambda: 112_583_507_968)  # the H200's
    assert jequi.products.edge_chunk_values(jnp.float32) == 112_583_507_968 // 8 // 4
    assert jequi.products.edge_chunk_values(jnp.float64) == 112_583_507_968 // 8 // 8
    monkeypatch.setattr(jequi.products, "_bytes_limit", lambda: None)
    assert jequi.products.edge_chunk_values(jnp.float32) == jequi.products.EDGE_CHUNK_VALUES == 2**30


def test_radial_conv_chunk_rule_and_errors(radial_tp, monkeypatch):
    tp = radial_tp
    rng = np.random.default_rng(5)
    x, y, _, s, r = graph(rng, tp, 5, 12)
    g = jequi.Graph.build(s, r, 5)
    h, k = rng.normal(size=(12, 3)), rng.normal(size=(3, tp.weight_numel))
    want = tp.conv(x, y, h @ k, g, backend="xla")
    # the rule: chunks of at most EDGE_CHUNK_VALUES weights where the device reports no memory (the
    # CPU; on a GPU its memory sets them: made to report none here)
    monkeypatch.setattr(jequi.products, "_bytes_limit", lambda: None)
    monkeypatch.setattr(jequi.products, "EDGE_CHUNK_VALUES", 4 * tp.weight_numel)
    jaxpr = str(jax.make_jaxpr(lambda x: tp.radial_conv(x, y, h, k, g, backend="xla"))(x))
    assert "scan" in jaxpr and "length=2" in jaxpr  # 3 chunks: the first starts the sum, a scan adds 2
    assert_close(tp.radial_conv(x, y, h, k, g, backend="xla"), want, 1e-12)
    # vmap over a batch of graphs
    xs, ys, hs = np.stack([x, 2 * x]), np.stack([y, -y]), np.stack([h, h])
    gs = jax.vmap(lambda s, r: jequi.Graph.build(s, r, 5))(np.stack([s, s]), np.stack([r, r]))
    out = jax.vmap(lambda x, y, h, g: tp.radial_conv(x, y, h, k, g, edge_chunks=2, backend="xla"))(xs, ys, hs, gs)
    assert_close(out[1], tp.conv(2 * x, -y, h @ k, g, backend="xla"), 1e-12)
    # hidden_fn: the MLP's earlier layers run per chunk; values and gradients as conv(x, y, f(b) @ K)
    b, w0 = rng.normal(size=(12, 2)), rng.normal(size=(2, 3))

    def mlp(w0):
        return lambda rows: jnp.tanh(rows @ w0)

    def radial(x, y, w0, k):
        return jnp.sum(tp.radial_conv(x, y, b, k, g, hidden_fn=mlp(w0), edge_chunks=3, backend="xla") ** 2)

    def plain(x, y, w0, k):
        return jnp.sum(tp.conv(x, y, mlp(w0)(b) @ k, g, backend="xla") ** 2)

    assert_close(radial(x, y, w0, k), plain(x, y, w0, k), 1e-12)
    grads = lambda f: jax.jit(jax.grad(f, (0, 1, 2, 3)))(x, y, w0, k)  # noqa: E731 (eagerly each op compiles alone)
    for a, b_ in zip(grads(radial), grads(plain)):
        assert_close(a, b_, 1e-10)
    with pytest.raises(ValueError, match="hidden_fn"):
        tp.radial_conv(x, y, b, k, g, hidden_fn=lambda rows: rows)
    with pytest.raises(ValueError, match="kernel has shape"):
        tp.radial_conv(x, y, h, k[:, :-1], g)
    with pytest.raises(ValueError, match="hidden has shape"):
        tp.radial_conv(x, y, h[:-1], k, g)
    with pytest.raises(ValueError, match="edge_chunks"):
        tp.radial_conv(x, y, h, k, g, edge_chunks=0)
    with pytest.raises(TypeError, match="needs a Graph or both senders and receivers"):  # raw indices need both
        tp.radial_conv(x, y, h, k, s)
