"""The one adapter of the kernel packages: ``pallas_kernels`` and ``ffi`` expose the same
functions with the same signatures (:mod:`pallas_kernels.ops`, :mod:`ffi.ops`), and
:func:`functions` makes a :class:`~jequi.backends.Backend`'s kernel functions of either, with
its knobs (``config``, the package's frozen ``Config``)."""

from __future__ import annotations

from ..sums import ALL, GZ, W, Sums


def functions(package, config) -> dict:
    """The :class:`~jequi.backends.Backend` fields ``check``, ``available``, ``forward``,
    ``backward``, ``second``, ``conv_forward``, ``conv_backward`` and ``conv_second`` of kernel
    package `package` with knobs `config`."""

    def check(desc):
        reason = package.unsupported_reason(desc)
        if reason:
            raise ValueError(f"{reason}; use another backend (backend='xla' runs every product)")

    def forward(desc, x, y, w):
        return package.forward(desc, x, y, w, config)

    def backward(desc, x, y, w, gz, needs=ALL):
        return package.backward(desc, x, y, w, gz, needs, config)

    def second(desc, sums: Sums, arrays):
        """The fused double backward: one backward-like kernel for ``dx, dy, dw`` that also
        sums ``dgz`` (``second_sum``, where ``fuses_second``), else that kernel and a
        forward-like one for ``dgz``; instead of up to three forward and three backward calls,
        each reading its own copies of the rows (one kernel per gradient was slower too:
        benchmarks/results/2026-11-21-h200-ab.md; docs/tuning.md#backends-pallas-second)."""
        if package.fuses_second(desc, arrays[GZ].dtype, sums, arrays[W].ndim == 1, config):
            return package.second_sum(desc, arrays, sums, config)
        return sums.evaluate(
            lambda s: package.forward_sum(desc, arrays, s, config), lambda s: package.backward_sum(desc, arrays, s, config)
        )

    def conv_forward(desc, x, y, w, graph, kahan: bool = False):
        return package.conv_forward(desc, x, y, w, graph, config, kahan=kahan)

    def conv_backward(desc, x, y, w, gz, graph, needs=ALL, kahan: bool = False):
        return package.conv_backward(desc, x, y, w, gz, graph, needs, config, kahan=kahan)

    def conv_second(desc, sums: Sums, arrays, graph, kahan: bool = False):
        """``second`` of the conv, in two kernels: ``dgz`` walks receivers, ``dx, dy, dw``
        senders (as the conv's backward does)."""
        return sums.evaluate(
            lambda s: package.conv_forward_sum(desc, arrays, graph, s, config, kahan=kahan),
            lambda s: package.conv_backward_sum(desc, arrays, graph, s, config, kahan=kahan),
        )

    return dict(
        check=check, available=package.available, forward=forward, backward=backward, second=second,
        conv_forward=conv_forward, conv_backward=conv_backward, conv_second=conv_second,
    )  # fmt: skip
