"""What the tests and the benchmarks share: independent serial references
(:mod:`.reference`: scipy's cKDTree and connected components, float64 brute force) and real
JaxPM snapshots cached on disk (:mod:`.snapshots`). Not imported by ``import jaxpm_halos``;
it needs scipy, and the snapshots need the JaxPM stack.
"""

import jax
from jax.sharding import AxisType


def make_mesh(shape, names=("x", "y")):
    """A device mesh of ``shape`` with Auto axes, as JaxPM's shard_maps need."""
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
