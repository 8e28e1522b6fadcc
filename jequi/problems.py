"""A catalogue of tensor products that real models build, by name.

The problems of OpenEquivariance's ``benchmark/problems.py`` (MACE, NequIP, NequIP-OAM,
Nequix, SevenNet, DiffDock, e3nn's tetris and tetris-poly, e3tools) and of the project's
BASELINES.md (its measured peers' speeds, kept outside this repository), built with
:func:`jequi.channelwise` (MACE's ``uvu`` construction) or :func:`jequi.fully_connected`
(``uvw``). Used by the tests and the benchmarks::

    tp = jequi.problems.get("mace-large")
"""

from __future__ import annotations

from .products import TensorProduct, channelwise, fully_connected

_NEQUIP_OAM_SH = "1x0e+1x1o+1x2e+1x3o"
_NEQUIP_OAM_HIDDEN = "128x0e+64x1o+32x2e+32x3o"

#: name -> (kind, irreps_in1, irreps_in2, irreps_out or filter)
CATALOGUE: dict[str, tuple[str, str, str, str]] = {
    # MACE
    "mace-large": ("uvu", "128x0e+128x1o+128x2e", "1x0e+1x1o+1x2e+1x3o", "128x0e+128x1o+128x2e+128x3o"),
    "mace-medium": ("uvu", "128x0e+128x1o", "1x0e+1x1o+1x2e+1x3o", "128x0e+128x1o+128x2e"),
    # NequIP
    "nequip-lips": ("uvu", "32x0o+32x0e+32x1o+32x1e+32x2o+32x2e", "0e+1o+2e", "32x0o+32x0e+32x1o+32x1e+32x2o+32x2e"),
    "nequip-revmd17-aspirin": ("uvu", "64x0o+64x0e+64x1o+64x1e", "0e+1o", "64x0o+64x0e+64x1o+64x1e"),
    "nequip-revmd17-toluene": (
        "uvu",
        "64x0o+64x0e+64x1o+64x1e+64x2o+64x2e",
        "0e+1o+2e",
        "64x0o+64x0e+64x1o+64x1e+64x2o+64x2e",
    ),
    "nequip-benzene": (
        "uvu",
        "64x0o+64x0e+64x1o+64x1e+64x2o+64x2e+64x3o+64x3e",
        "0e+1o+2e+3o",
        "64x0o+64x0e+64x1o+64x1e+64x2o+64x2e+64x3o+64x3e",
    ),
    "nequip-water": ("uvu", "32x0o+32x0e+32x1o+32x1e", "0e+1o", "32x0o+32x0e+32x1o+32x1e"),
    # NequIP OAM (mixed multiplicities)
    "nequip-oam-first": ("uvu", "32x0e", _NEQUIP_OAM_SH, _NEQUIP_OAM_HIDDEN),
    "nequip-oam-main": ("uvu", _NEQUIP_OAM_HIDDEN, _NEQUIP_OAM_SH, _NEQUIP_OAM_HIDDEN),
    "nequip-oam-last": ("uvu", _NEQUIP_OAM_HIDDEN, _NEQUIP_OAM_SH, "128x0e"),
    # Nequix
    "nequix-first": ("uvu", "89x0e", "1x0e+1x1o+1x2e+1x3o", "89x0e+89x1o+89x2e+89x3o"),
    "nequix-main": ("uvu", "128x0e+64x1o+32x2e+32x3o", "1x0e+1x1o+1x2e+1x3o", "0e+1o+2e+3o"),
    "nequix-last": ("uvu", "128x0e+64x1o+32x2e+32x3o", "1x0e+1x1o+1x2e+1x3o", "128x0e"),
    # SevenNet
    "sevennet-first": ("uvu", "128x0e", "1x0e+1x1e+1x2e+1x3e", "128x0e+128x1e+128x2e+128x3e"),
    "sevennet-main": ("uvu", "128x0e+64x1e+32x2e+32x3e", "1x0e+1x1e+1x2e+1x3e", "0e+1e+2e+3e"),
    "sevennet-last": ("uvu", "128x0e+64x1e+32x2e+32x3e", "1x0e+1x1e+1x2e+1x3e", "128x0e"),
    # Fully connected (uvw)
    "diffdock-l1": ("uvw", "10x1o+10x1e+48x0e+48x0o", "1x0e+1x1o", "10x1o+10x1e+48x0e+48x0o"),
    "diffdock-l2": ("uvw", "10x1o+10x1e+48x0e+48x0o", "1x0e+1x1o+1x2e", "10x1o+10x1e+48x0e+48x0o"),
    "tetris-poly-1": ("uvw", "1x0e+1x1o+1x2e+1x3o", "1x0e+1x1o+1x2e+1x3o", "64x0e+24x1e+24x1o+16x2e+16x2o"),
    "tetris-poly-2": ("uvw", "64x0e+24x1e+24x1o+16x2e+16x2o", "1x0e+1x1o+1x2e", "0o+6x0e"),
    "e3tools-conv": ("uvw", "64x0e+16x1o", "1x0e+1x1o", "80x0e+16x1o"),
    "e3tools-transformer": ("uvw", "64x0e+16x1o", "1x0e+1x1o", "64x0e+16x1o"),
    # e3nn's tetris example, its fully connected layers
    "tetris-0-sc": ("uvw", "1x0e", "1x0e", "150x0e+50x1o+50x2e"),
    "tetris-0-lin2": ("uvw", "1x0e+1x1o+1x2e", "1x0e", "150x0e+50x1o+50x2e"),
    "tetris-1-sc": ("uvw", "50x0e+50x1o+50x2e", "1x0e", "250x0e+50x1o+50x1e+50x2o+50x2e"),
    "tetris-1-lin2": ("uvw", "150x0e+200x1o+100x1e+100x2o+200x2e", "1x0e", "250x0e+50x1o+50x1e+50x2o+50x2e"),
    "tetris-2-lin2": (
        "uvw",
        "100x0o+150x0e+300x1o+250x1e+250x2o+300x2e",
        "1x0e",
        "50x0o+250x0e+50x1o+50x1e+50x2o+50x2e",
    ),
    "tetris-3-sc": ("uvw", "50x0o+50x0e+50x1o+50x1e+50x2o+50x2e", "1x0e", "1x0o+6x0e"),
}


def names(kind: str | None = None) -> list[str]:
    """Names in the catalogue, optionally only the ``"uvu"`` or ``"uvw"`` ones."""
    return [n for n, spec in CATALOGUE.items() if kind is None or spec[0] == kind]


def get(name: str, **kwargs) -> TensorProduct:
    """Build the named product (keyword arguments go to :class:`jequi.TensorProduct`)."""
    if name not in CATALOGUE:
        raise ValueError(f"unknown problem {name!r}; known: {', '.join(CATALOGUE)}")
    kind, in1, in2, out = CATALOGUE[name]
    build = channelwise if kind == "uvu" else fully_connected
    return build(in1, in2, out, **kwargs)
