"""jequi.tensor_product against e3nn_jax.tensor_product (values, irreps, zero flags, gradients,
broadcasting), the migration notes' snippets, and the traps of issue 47 (channelwise with no
filter, IrrepsArray into an ir_mul product, errors inside JAX transforms)."""

import pathlib
import re

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

import jequi
from jequi import drop_in

MIXED = [
    ("2x0e+3x1o+1x2e+0e", "0e+1o+2e+1o"),  # unsorted, repeated irreps: regrouping matters
    ("1o+2x0e", "0o+2o"),  # e3nn's docstring example
    ("4x1e+2x0o", "1o+0e+3x1o"),
]
FILTERS = [None, "0e+1e+2o", ["1o", "0e"], e3nn.Irrep("1e")]


def irreps_array(irreps, leading, seed):
    irreps = e3nn.Irreps(irreps)
    return e3nn.IrrepsArray(irreps, jax.random.normal(jax.random.key(seed), (*leading, irreps.dim), jnp.float64))


@pytest.mark.parametrize("irreps1, irreps2", MIXED)
@pytest.mark.parametrize("regroup", [True, False])
def test_values_irreps_and_order_equal_e3nn(irreps1, irreps2, regroup):
    x, y = irreps_array(irreps1, (4,), 0), irreps_array(irreps2, (4,), 1)
    options = [(f, None) for f in FILTERS] + [(None, n) for n in ("component", "norm", "none")]
    for filter_ir_out, normalization in options:
        kw = dict(filter_ir_out=filter_ir_out, irrep_normalization=normalization, regroup_output=regroup)
        ref = e3nn.tensor_product(x, y, **kw)
        out = jequi.tensor_product(x, y, backend="xla", **kw)
        assert isinstance(out, e3nn.IrrepsArray)
        assert out.irreps == ref.irreps, (kw, out.irreps, ref.irreps)
        assert tuple(out.zero_flags) == tuple(ref.zero_flags)
        assert_close(out.array, ref.array, 1e-12, str(kw))
        assert jequi.tensor_product(irreps1, irreps2, **kw) == ref.irreps  # irreps alone, as e3nn


def test_config_default_normalization_is_e3nns():
    x, y = irreps_array("2x0e+1o", (3,), 0), irreps_array("1o+2e", (3,), 1)
    try:
        e3nn.config("irrep_normalization", "norm")
        ref = e3nn.tensor_product(x, y)
        out = jequi.tensor_product(x, y)
    finally:
        e3nn.config("irrep_normalization", "component")
    assert_close(out.array, ref.array, 1e-12)
    assert not np.allclose(out.array, jequi.tensor_product(x, y).array)  # the option mattered


def test_leading_dims_broadcast_and_plain_arrays():
    x, y = irreps_array("2x0e+1o", (3, 1), 0), irreps_array("0e+1o+2e", (5,), 1)
    ref, out = e3nn.tensor_product(x, y), jequi.tensor_product(x, y)
    assert out.shape == ref.shape == (3, 5, ref.irreps.dim)
    assert_close(out.array, ref.array, 1e-12)
    # plain arrays are scalars (Nx0e), integer ones become the default float dtype, as in e3nn
    a, b = jnp.arange(6).reshape(2, 3), jnp.arange(4).reshape(2, 2)
    ref, out = e3nn.tensor_product(a, b), jequi.tensor_product(a, b)
    assert out.irreps == ref.irreps and out.dtype == ref.dtype
    assert_close(out.array, ref.array, 1e-12)


def test_gradients_equal_e3nns_under_jit():
    x, y = irreps_array("3x0e+2x1o+1x2e", (6,), 0), irreps_array("0e+1o+2e", (6,), 1)
    c = jax.random.normal(jax.random.key(2), (6, e3nn.tensor_product(x.irreps, y.irreps, filter_ir_out="0e+1o+2e").dim))

    def loss(f):
        return lambda a, b: jnp.sum(c * f(e3nn.IrrepsArray(x.irreps, a), e3nn.IrrepsArray(y.irreps, b), filter_ir_out="0e+1o+2e").array)

    ref = jax.grad(loss(e3nn.tensor_product), argnums=(0, 1))(x.array, y.array)
    got = jax.jit(jax.grad(loss(jequi.tensor_product), argnums=(0, 1)))(x.array, y.array)
    for g, r in zip(got, ref):
        assert_close(g, r, 1e-12)


def test_zero_flags_empty_outputs_and_zero_multiplicities():
    x = e3nn.from_chunks("2x0e+1o+0x2e", [None, jnp.ones((1, 3)), None], (), jnp.float64)
    y = e3nn.IrrepsArray("0e+1o", jnp.arange(4.0))
    for regroup in (True, False):
        ref, out = e3nn.tensor_product(x, y, regroup_output=regroup), jequi.tensor_product(x, y, regroup_output=regroup)
        assert out.irreps == ref.irreps and tuple(out.zero_flags) == tuple(ref.zero_flags)
        assert any(out.zero_flags) != regroup  # regrouping merges the zero blocks with others
        assert_close(out.array, ref.array, 1e-12)
    # a filter that keeps nothing: an empty output, as in e3nn
    out = jequi.tensor_product(irreps_array("1o", (2,), 0), irreps_array("1o", (2,), 1), filter_ir_out="3e")
    assert out.irreps == e3nn.Irreps("") and out.shape == (2, 0)
    # no rows
    out = jequi.tensor_product(irreps_array("1o", (0,), 0), irreps_array("1o", (0,), 1))
    assert out.shape == (0, 9)


def test_product_is_built_once_per_case_and_backend_is_passed_through():
    x, y = irreps_array("2x0e+1o", (3,), 0), irreps_array("1o", (3,), 1)
    key = (x.irreps, y.irreps, (False, False), (False,), None, "component", True)
    assert drop_in._plan(*key) is drop_in._plan(*key)
    plan = drop_in._plan(*key)
    # input 2 has multiplicity one: uvu paths (the kernels' mode), unweighted
    assert {ins[3] for ins in plan.tp.instructions} == {"uvu"} and plan.tp.weight_numel == 0
    x2 = irreps_array("2x1o", (3,), 2)
    assert {ins[3] for ins in drop_in._plan(y.irreps, x2.irreps, (False,), (False,), None, "component", True).tp.instructions} == {"uvv"}
    assert {ins[3] for ins in drop_in._plan(x2.irreps, x2.irreps, (False,), (False,), None, "component", True).tp.instructions} == {"uvuv"}
    assert_close(jequi.tensor_product(y, x2).array, e3nn.tensor_product(y, x2).array, 1e-12)
    # the chosen backend reaches the product: Pallas' kernels do not run uvuv paths and say so
    with pytest.raises(ValueError, match="pallas"):
        jequi.tensor_product(x2, x2, backend="pallas")
    with pytest.raises(ValueError, match="irrep_normalization"):
        jequi.tensor_product(x, y, irrep_normalization="unit")
    with pytest.raises(TypeError, match="two irreps"):
        jequi.tensor_product("1o", y)


def test_result_feeds_e3nn_operations():
    """``* radial`` and ``scatter_sum`` on jequi's output give e3nn's numbers (the migration path)."""
    x, y = irreps_array("4x0e+2x1o", (7,), 0), irreps_array("0e+1o+2e", (7,), 1)
    ref, out = e3nn.tensor_product(x, y), jequi.tensor_product(x, y)
    radial = jax.random.normal(jax.random.key(3), (7, ref.irreps.num_irreps), jnp.float64)
    dst = jnp.array([0, 1, 1, 2, 0, 2, 2])
    a = e3nn.scatter_sum(out * radial, dst=dst, output_size=3)
    b = e3nn.scatter_sum(ref * radial, dst=dst, output_size=3)
    assert a.irreps == b.irreps
    assert_close(a.array, b.array, 1e-12)


# --- the migration notes: every snippet runs, and asserts its own equivalence --------------------
DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "migration.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


@pytest.mark.parametrize("n", range(len(SNIPPETS)))
def test_migration_snippet_runs(n):
    assert len(SNIPPETS) == 4
    exec(compile(SNIPPETS[n], f"docs/migration.md snippet {n}", "exec"), {})


def test_e3nn_migration_snippet_is_the_conv_equivalence():
    snippet = next(s for s in SNIPPETS if "scatter_sum" in s)
    scope = {}
    exec(compile(snippet, "docs/migration.md", "exec"), scope)
    assert_close(scope["out"].array, scope["out_e3nn"].array, 1e-5)
    assert np.abs(scope["out_e3nn"].array).max() > 0.1


# --- traps -----------------------------------------------------------------------------------------
def test_channelwise_without_filter_keeps_every_output():
    tp = jequi.channelwise("2x0e+1o", "0e+1o", None)
    allowed = {ir for _, ir in e3nn.tensor_product("2x0e+1o", "0e+1o")}
    assert {ir for _, ir in tp.irreps_out} == allowed and tp.weight_numel > 0
    with pytest.raises(ValueError, match="no path"):
        jequi.channelwise("2x0e+1o", "0e+1o", "3e")


def test_irreps_array_into_ir_mul_product_raises():
    tp = jequi.channelwise("2x0e+2x1o", "0e+1o", "0e+1o", layout="ir_mul")
    x, y = irreps_array("2x0e+2x1o", (3,), 0), irreps_array("0e+1o", (3,), 1)
    w = np.ones((3, tp.weight_numel))
    with pytest.raises(ValueError, match="ir_mul"):
        tp(x, y.array, w)
    with pytest.raises(ValueError, match="ir_mul"):
        tp.conv(x.array, y, w, np.array([0, 1, 2]), np.array([1, 2, 0]))
    tp(x.array, y.array, w)  # plain arrays are read as ir_mul


def test_traced_num_nodes_names_jequi_and_the_fix():
    tp = jequi.channelwise("2x0e", "0e", "0e")
    s, r = jnp.array([0, 1]), jnp.array([1, 0])
    x, y, w = jnp.ones((2, 2)), jnp.ones((2, 1)), jnp.ones((2, 2))
    with pytest.raises(ValueError, match=r"jequi: num_nodes .*static_argnums"):
        jax.jit(lambda s, r, n: jequi.Graph.build(s, r, n))(s, r, 2)
    with pytest.raises(ValueError, match=r"jequi: num_nodes .*static_argnums"):
        jax.jit(tp.conv)(x, y, w, s, r, 2)
    out = jax.jit(tp.conv, static_argnums=5)(x, y, w, s, r, 2)  # the fix the message names
    assert_close(out, tp.conv(x, y, w, s, r, 2), 1e-12)
    assert jequi.Graph.build(s, r, jnp.int32(2)).num_nodes == 2  # a concrete integer scalar is fine


def test_graph_as_static_jit_argument_names_jequi_and_the_fix():
    tp = jequi.channelwise("2x0e", "0e", "0e")
    graph = jequi.Graph.build(jnp.array([0, 1]), jnp.array([1, 0]), 2)
    x, y, w = jnp.ones((2, 2)), jnp.ones((2, 1)), jnp.ones((2, 2))
    f = lambda x, g: tp.conv(x, y, w, g)  # noqa: E731
    with pytest.raises(ValueError, match="Non-hashable static") as info:
        jax.jit(f, static_argnums=1)(x, graph)
    assert "jequi.Graph is not hashable" in repr(info.value.__cause__) + str(info.value)
    assert_close(jax.jit(f)(x, graph), f(x, graph), 1e-12)  # as a regular argument it works
