"""The main job: a distributed JaxPM run with in-situ halo finding and kNN density.

Run it with::

    python -m jaxpm_halos.demo [--nc 64] [--box 128] [--steps 20]
        [--snapshots 0.5,0.625,0.75,0.875,1.0] [--mesh 2,4] [--pm-factor 2] [--no-m200m]
        [--centre peak] [--b 0.2] [--min-members 20] [--k 16] [--out halos_out]

(``--help`` lists every option.)

On a machine with only a CPU, the run is spread over 8 XLA host devices (a ``(2, 4)``
mesh) unless ``XLA_FLAGS`` already chooses a device count; otherwise it uses all local
devices. The simulation follows JaxPM's distributed recipe: a linear field, 2LPT to
``a = 0.1``, then ``--steps`` PM steps with diffrax's ``LeapfrogMidpoint`` (with diffrax's
text progress meter) to the last snapshot, on a PM grid of ``--pm-factor`` cells per
particle spacing (:func:`jaxpm_halos.pm.refined_pm_ode` when above 1). At each snapshot,
inside the jitted solve (``diffrax.SaveAt(ts=snapshots, fn=...)``),
:class:`jaxpm_halos.InSitu` runs FoF (``--b``, ``--min-members``) and the kNN density
(``--k``) on the sharded state.

At the end it prints, per snapshot, the number of halos, the largest masses (Msun/h), the
median kNN density, and the time of the analyses against one PM step: the compiled solve
is run again with the analyses switched off by a traced flag (``lax.cond``), and once per
snapshot with them on at that snapshot only (``--timing``). It writes to ``--out`` the run
directory ``run/`` of :func:`jaxpm_halos.write_run` (each snapshot's HDF5 catalogue with
member ids and merger links, the main-branch tree and a halo light cone to
``--lightcone-z``), ``accretion_histories.png``, ``mass_function.png`` (FoF masses
against the Watson et al. 2013 FoF fit and, unless ``--no-m200m``, beside them the in-situ
spherical-overdensity M200m of the same haloes, about their density peaks or centres of
mass (``--centre``), against Tinker et al. 2008) and ``density_slice.png``, and prints the
counts against the fits.

This module is only the command line: the run itself is
:func:`jaxpm_halos.simulation.run_simulation`.

This module imports jaxpm, jaxdecomp, jax_cosmo and diffrax; ``import jaxpm_halos`` does not.
"""

from ..pm import default_halo_size, refined_pm_ode
from ..simulation import (
    default_mesh_shape,
    demo_cosmology,
    describe_layout,
    run_simulation,
    switchable_saveat_fn,
    use_host_devices,
)
from .cli import main

# Scripts written before the driver left the demo import these names from it.
__all__ = [
    "default_halo_size",
    "default_mesh_shape",
    "demo_cosmology",
    "describe_layout",
    "main",
    "refined_pm_ode",
    "run_simulation",
    "switchable_saveat_fn",
    "use_host_devices",
]
