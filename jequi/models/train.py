"""Training any architecture (:class:`jequi.models.architecture.Architecture`: NequIP, MACE, Nequix, E2Former) on energies and forces with optax.

The force loss differentiates ``-dE/dpositions`` with respect to the parameters: a second
derivative of every convolution, which jequi evaluates with the seven-op rule.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from .data import Batch, Structure, batch, structure_edges
from .loss import errors
from .nequip import NequIPConfig
from .precision import with_precision


def fit_species_shift(config: NequIPConfig, structures: list[Structure]) -> np.ndarray:
    """Least-squares per-species energies: the initial ``species_shift``."""
    counts = np.array([np.bincount(config.species_index(s.numbers), minlength=len(config.species)) for s in structures])
    energies = np.array([s.energy for s in structures])
    return np.linalg.lstsq(counts, energies, rcond=None)[0]


def make_batches(structures, config, batch_size: int):
    """Batches of `batch_size` structures (the last may hold fewer, padded with empty structures),
    all padded to one shape (one compilation): the most atoms and the most edges that any one
    batch holds. Padding to
    ``batch_size x`` the largest structure instead left most of a batch's edges padding, and
    the model's per-edge work (radial MLP, spherical harmonics) runs on those too
    (benchmarks/results/2026-11-27-model-step-notes.md; docs/tuning.md#train-make_batches)."""
    edges = structure_edges(structures, config.cutoff)
    starts = range(0, len(structures), batch_size)
    n_atoms = max(sum(len(s.numbers) for s in structures[i : i + batch_size]) for i in starts)
    n_edges = max(sum(len(e[0]) for e in edges[i : i + batch_size]) for i in starts)
    n_graph = min(batch_size, len(structures))
    batches = [batch(structures[i : i + batch_size], config, n_atoms, n_edges, edges[i : i + batch_size], n_graph) for i in starts]
    # A batch without padding edges may be in receiver order (Graph.edges_sorted, a static
    # field): one value for all keeps them one compilation.
    if len({b.graph.edges_sorted for b in batches}) > 1:
        batches = [dataclasses.replace(b, graph=dataclasses.replace(b.graph, edges_sorted=False)) for b in batches]
    return config.prepare_batches(batches)  # the model's graph form (E2Former: Neighbors)


@dataclasses.dataclass
class History:
    """Per-step training loss and per-evaluation validation metrics."""

    step: list = dataclasses.field(default_factory=list)
    loss: list = dataclasses.field(default_factory=list)
    val_step: list = dataclasses.field(default_factory=list)
    val_energy_mae: list = dataclasses.field(default_factory=list)  # eV/atom
    val_force_mae: list = dataclasses.field(default_factory=list)  # eV/Å
    times: list = dataclasses.field(default_factory=list)  # wall s at each step's end (the first compiles)
    seconds: float = 0.0  # wall time of the training loop

    def seconds_per_step(self) -> float:
        """Mean wall time of a step after the first (which includes compilation)."""
        return (self.times[-1] - self.times[0]) / max(1, len(self.times) - 1)


@functools.partial(jax.jit, static_argnums=1)
def _metrics(params, config, b: Batch) -> dict:
    return errors(params, config, b)[1]


def evaluate(params, config, batches) -> dict:
    """Energy MAE (eV/atom) and force MAE (eV/Å) over batches, weighted by size."""
    e = f = atoms = graphs = 0.0
    for b in batches:
        m = _metrics(params, config, b)
        k, n = float(jnp.sum(b.num_atoms > 0)), float(jnp.sum(b.node_mask))
        e, f, graphs, atoms = e + float(m["energy_mae"]) * k, f + float(m["force_mae"]) * n, graphs + k, atoms + n
    return {"energy_mae": e / graphs, "force_mae": f / atoms}


def cosine_learning_rate(step: int, total: int, learning_rate: float, alpha: float = 0.05) -> float:
    """``optax.cosine_decay_schedule(learning_rate, total, alpha)`` at `step`, on the host (the
    schedule of :func:`train`, whose total may be fixed only after timing the first steps)."""
    t = min(step, total) / max(total, 1)
    return learning_rate * ((1 - alpha) * 0.5 * (1 + np.cos(np.pi * t)) + alpha)


def train(
    config: NequIPConfig,
    train_set: list[Structure],
    val_set: list[Structure] | None = None,
    steps: int = 200,
    batch_size: int = 4,
    learning_rate: float = 5e-3,
    seed: int = 0,
    params=None,
    progress: bool = True,
    eval_every: int = 50,
    energy_weight: float = 1.0,
    force_weight: float = 1.0,
    seconds: float | None = None,
    log=None,
    devices: int = 1,
    precision: str | None = None,
):
    """Train with Adam (cosine-decayed learning rate) on energies and forces; returns
    ``(params, history)``. A progress bar shows the loss; validation MAEs are logged every
    `eval_every` steps (to `log`, a function of a line, if given). `seconds`: a wall-time budget
    for the loop; the step count is then set after timing the first steps (at most `steps`),
    and the learning rate decays over that count. `devices` > 1: data-parallel over that many
    devices, each batch split between them (:mod:`jequi.models.data_parallel`; the same steps).
    `precision`: the model's precision policy for the run (:mod:`jequi.models.precision`; None:
    the config's)."""
    import optax
    from tqdm.auto import tqdm

    config = with_precision(config, precision)
    if devices > 1:
        from . import data_parallel
        from .mesh import device_mesh

        mesh = device_mesh(devices)
        batches = [data_parallel.put(b, mesh) for b in data_parallel.sharded_batches(train_set, config, batch_size, devices)]
    else:
        batches = make_batches(train_set, config, batch_size)
    val_batches = make_batches(val_set, config, batch_size) if val_set else []
    if getattr(config, "precision", "float32") != "float32" and batches[0].positions.dtype == jnp.float64:
        raise ValueError(f"precision={config.precision!r} trains a float32 model; the batches are float64 (jax_enable_x64 is on)")
    if params is None:
        b = batches[0] if devices == 1 else jax.tree.map(lambda a: a[0], batches[0])
        params = config.init_params(jax.random.key(seed), b.species, b.positions, b.graph, b.cell)
        params = config.with_species_energies(params, fit_species_shift(config, train_set))
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate)
    opt_state = optimizer.init(params)
    if devices > 1:  # on every device, as each step returns them: the step compiles once
        params, opt_state = data_parallel.replicate((params, opt_state), mesh)
    lr_dtype = opt_state.hyperparams["learning_rate"].dtype  # set every step as a (non-weak) array: one compilation

    def one_device_step(params, opt_state, b):
        (_, metrics), grads = jax.value_and_grad(errors, has_aux=True)(params, config, b, energy_weight, force_weight)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    if devices > 1:
        step = data_parallel.train_step(config, optimizer, mesh, energy_weight, force_weight)
    else:
        step = jax.jit(one_device_step)

    history = History()
    order = np.random.default_rng(seed).permutation
    bar = tqdm(total=steps, disable=not progress, desc="training", unit="step")
    write = log or bar.write
    queue = []
    calibrate = 10  # steps timed (after the compiling first) before a time budget fixes the count
    t0 = time.perf_counter()
    i = 0
    while i < steps:
        if not queue:
            queue = list(order(len(batches)))
        opt_state.hyperparams["learning_rate"] = jnp.asarray(cosine_learning_rate(i, steps, learning_rate), lr_dtype)
        params, opt_state, metrics = step(params, opt_state, batches[queue.pop()])
        history.step.append(i)
        history.loss.append(float(metrics["loss"]))
        history.times.append(time.perf_counter() - t0)
        if seconds is not None and i + 1 == min(calibrate, steps):
            per_step = history.seconds_per_step()
            steps = min(steps, i + 1 + max(0, int((seconds - history.times[-1]) / max(per_step, 1e-9))))
            bar.total = steps
            bar.refresh()
            write(f"time budget {seconds:.0f} s: {steps} steps of {1e3 * per_step:.2f} ms (first step {history.times[0]:.1f} s)")
        bar.update(1)
        bar.set_postfix(loss=f"{history.loss[-1]:.4f}")
        i += 1
        if val_batches and (i % eval_every == 0 or i == steps):
            m = evaluate(params, config, val_batches)
            history.val_step.append(i)
            history.val_energy_mae.append(m["energy_mae"])
            history.val_force_mae.append(m["force_mae"])
            write(f"step {i}: val energy MAE {1e3 * m['energy_mae']:.1f} meV/atom, force MAE {1e3 * m['force_mae']:.1f} meV/A")
    bar.close()
    history.seconds = time.perf_counter() - t0
    return params, history
