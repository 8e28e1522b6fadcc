"""The shipped weights against their references, so corrupted weights fail: nequip-emt against
ase's EMT on held-out structures (the card's generator and seed), within 1.5x the card's errors.
The Nequix models are checked against Nequix's own code in tests/test_nequix.py."""

import json

import numpy as np

from jequi.models import JequiCalculator, data, pretrained


def test_nequip_emt_meets_its_card_on_held_out_structures():
    meta = json.loads((pretrained.WEIGHTS / f"{pretrained.NAME}.json").read_text())
    structures = data.emt_dataset(24, seed=2)  # the card's held-out set is seed 2 (pretrained.main)
    calc = JequiCalculator(pretrained.NAME, dtype="float64")
    de, df = [], []
    for s in structures:
        atoms = s.to_atoms()
        atoms.calc = calc
        de.append(abs(atoms.get_potential_energy() - s.energy) / len(atoms))
        df.append(np.abs(atoms.get_forces() - s.forces).ravel())
    energy_mae, force_mae = float(np.mean(de)), float(np.mean(np.concatenate(df)))
    assert energy_mae < 1.5 * meta["val_energy_mae_eV_per_atom"], energy_mae
    assert force_mae < 1.5 * meta["val_force_mae_eV_per_A"], force_mae
    assert force_mae > 0.1 * meta["val_force_mae_eV_per_A"]  # a model, not the labels themselves
