"""Frozen, hashable configuration objects (usable as static ``jit`` arguments).

Capacities are given as *factors* of the mean number of particles per device,
``n0 = N / n_devices``, so one configuration suits every problem size and mesh.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def _rows(factor: float, n0: int) -> int:
    return max(1, math.ceil(factor * n0))


# Rows added to the default exchange buffers. With a few hundred particles per device (16^3
# on 8 devices) a face layer's count or a block's strays fluctuate by as much as the
# margins in the factors; on large problems these rows cost nothing.
_SMALL_PROBLEM_ROWS = 128


def _default_rows(factor: float, n0: int, given: float | None) -> int:
    return _rows(factor, n0) + (_SMALL_PROBLEM_ROWS if given is None else 0)


def _check_numbers(config) -> None:
    """Every number a config holds is finite and >= 0, and every count an integer >= 1 (None
    picks the default): other settings would otherwise fail deep inside a compiled program."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is None or dataclasses.is_dataclass(value) or field.type == "str":
            continue
        number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
            value, bool
        )
        if not (number and math.isfinite(value) and value >= 0):
            raise ValueError(
                f"{type(config).__name__}({field.name}={value!r}): a setting must "
                "be a finite number >= 0, or None for the default"
            )
        # Counts (rows, queries, steps) are shapes: 0 or 1.5 would fail deep in the trace.
        counts = field.type.startswith("int")
        if counts and not (isinstance(value, (int, np.integer)) and value >= 1):
            default = " (or None for the default)" if "None" in field.type else ""
            raise ValueError(
                f"{type(config).__name__}({field.name}={value!r}): this setting "
                f"is a count, an integer >= 1{default}"
            )


SEARCHES = ("auto", "tree", "scan")  # KNNConfig.search


@dataclasses.dataclass(frozen=True)
class DomainConfig:
    """Buffer sizes of the pencil-domain exchange (see :mod:`jaxpm_halos.core.domain`).

    Attributes:
      capacity_factor: rows per device for the particles a domain owns after migration,
        in units of ``n0``. Clustering makes domains unequal; 2 suits z=0 JaxPM runs.
      transfer_factor: rows per device pair and migration stage, in units of ``n0``.
        ``None`` picks 0.6 for JaxPM grids, whose particles stray a few cells from their
        lattice block, and 1.0 for flat input, which may arrive in any order (a device
        never sends more than the ``n0`` rows it has in the first stage).
      ghost_factor: rows for the ghost copies sent through one domain face, in units of
        ``n0``. Ghost layers are as wide as the analysis needs (the linking length for FoF,
        the k-th neighbour distance for kNN). ``None`` sizes them from the layer's width
        ``f`` as a fraction of the narrower pencil side: ``2 f (1 + 2 f) + 0.05``, twice the
        mean share of a face layer with its corners.
      image_factor: rows for the periodic images along z (z is never cut, so rows within
        the layer width of z = 0 and z = L are copied locally), per side, in units of
        ``n0``. ``None`` sizes them like the ghosts, from the width as a fraction of the box.

    Each ``None`` default also adds 128 rows, for small problems (a few hundred particles per
    device), where these counts fluctuate by as much as the factors' margins.
    """

    capacity_factor: float = 2.0
    transfer_factor: float | None = None
    ghost_factor: float | None = None
    image_factor: float | None = None

    def __post_init__(self):
        _check_numbers(self)

    def capacity_rows(self, n0: int) -> int:
        return _rows(self.capacity_factor, n0)

    def transfer(self, grid: bool) -> float:
        if self.transfer_factor is not None:
            return self.transfer_factor
        return 0.6 if grid else 1.0

    def transfer_rows(self, n0: int, grid: bool) -> int:
        return _default_rows(self.transfer(grid), n0, self.transfer_factor)

    def ghost(self, width_fraction: float) -> float:
        if self.ghost_factor is not None:
            return self.ghost_factor
        return 2 * width_fraction * (1 + 2 * width_fraction) + 0.05

    def ghost_rows(self, n0: int, width_fraction: float) -> int:
        return _default_rows(self.ghost(width_fraction), n0, self.ghost_factor)

    def image(self, width_fraction: float, box_fraction: float) -> float:
        if self.image_factor is not None:
            return self.image_factor
        return 2 * box_fraction * (1 + 4 * self.ghost(width_fraction)) + 0.05

    def image_rows(self, n0: int, width_fraction: float, box_fraction: float) -> int:
        return _default_rows(self.image(width_fraction, box_fraction), n0, self.image_factor)


@dataclasses.dataclass(frozen=True)
class KNNConfig:
    """k-nearest-neighbour settings. None of them changes the results, only the cost, except
    that a buffer that is too small is reported (see :class:`~jaxpm_halos.Status`).

    Attributes:
      ghost_width: width of the ghost layer around each pencil, in the unit of the
        positions. ``None`` picks ``ghost_factor`` times the k-th neighbour distance of a
        uniform density, capped at the pencil width. Particles whose k-th neighbour lies
        farther than the ghost layer reaches are completed by a cross-device pass.
      ghost_factor: see ``ghost_width``.
      batch_size: queries searched together; each batch of spatially consecutive queries
        shares one set of candidate rows.
      chunk_size: candidates per step, merged into the running k nearest of the queries
        they come nearer to. On GPUs a merge row (the running list and the chunk) is made
        a power of two of at least 1024 values, the rows XLA's top-k kernel takes (fewer
        are sorted).
      group_size: batches processed side by side in one step (vectorised). Queries searched
        again (their k-th neighbour lay beyond the first search) are scattered: they go in
        batches of at most 4, with ``batch_size * group_size`` queries per step. ``None``
        picks 8 when JAX's default backend is the CPU and 1024 otherwise: a GPU pays a
        fixed cost per step (about 20x slower kNN at 128^3 with the CPU setting).
      radius_factor: first-pass search radius relative to the k-th neighbour distance
        estimated from the batch's own density. Queries whose k-th neighbour lies beyond
        the searched region are searched again with that distance as radius.
      remote_factor: rows per device for queries whose search sphere leaves the ghost
        layer (solved against every device's particles), in units of ``n0``; at least 32
        and at most the device's query rows.
        ``None`` picks 1/64, or 1 when the ghost layer had to be capped at the pencil
        width (pencils narrower than the neighbour spheres). The public functions rerun
        with a larger value when it overflows.
      index_factor: rows per device of the search index (the valid owned rows, ghosts and
        z images, sorted), in units of ``n0``. The exchange buffers each hold their own
        worst case, so most of their rows are padding; the index keeps only valid ones.
        ``None`` picks the domain's ``capacity_factor`` times the frame's volume over the
        pencil's (the frame may be as dense as the densest owned pencil), plus 128 rows,
        and at most every exchanged row.
      domain: the domain exchange buffers.
    """

    ghost_width: float | None = None
    ghost_factor: float = 2.0
    batch_size: int = 16
    chunk_size: int = 256
    group_size: int | None = None
    radius_factor: float = 1.0
    remote_factor: float | None = None
    index_factor: float | None = None
    search: str = "auto"
    domain: DomainConfig = dataclasses.field(default_factory=DomainConfig)

    def __post_init__(self):
        _check_numbers(self)
        if self.search not in SEARCHES:
            raise ValueError(
                f"KNNConfig(search={self.search!r}): choose one of "
                + ", ".join(repr(v) for v in SEARCHES)
            )

    def index_rows(self, n0: int, default_factor: float, exchanged: int) -> int:
        """Rows of the search index: ``index_factor`` (else ``default_factor``) times
        ``n0``, and never more than the ``exchanged`` rows it is selected from."""
        factor = default_factor if self.index_factor is None else self.index_factor
        return min(exchanged, _default_rows(factor, n0, self.index_factor))

    def remote_rows(self, n0: int, capped: bool = False) -> int:
        factor = self.remote_factor
        if factor is None:
            factor = 1.0 if capped else 1 / 64
        # No cap here: the caller caps it at the device's query rows, which a clustered
        # device can fill up to capacity_factor * n0.
        return max(32, _rows(factor, n0))


@dataclasses.dataclass(frozen=True)
class SOConfig:
    """Spherical-overdensity settings. None of them changes the results, only the cost,
    except that a search radius or a buffer that is too small is reported (see
    :class:`~jaxpm_halos.Status`).

    Attributes:
      radius: the largest SO radius that can be measured, in the unit of the positions
        (also the width of the ghost layer). ``None`` picks 4 mean particle separations
        (the R200m of a halo of ~50,000 particles). It must stay below a third of the box
        and within the narrower pencil side.
      levels: searches of radius ``radius / 2**(levels - 1)``, ..., ``radius / 2``,
        ``radius``: a centre is searched again, twice as far, only while its profile has
        not fallen below the threshold, so small haloes cost a small search.
      pair_factor: rows of the buffer of candidate (centre, particle) pairs handled at once,
        in units of ``n0``. Centres are handled in batches that fit; the candidates of one
        centre must fit. ``None`` picks 1, plus 128 rows.
      smooth_factor: with ``smoothing``, rows of the buffer of the particles whose weight
        lies strictly between 0 and 1 (the windows that the derivative needs), summed over
        a device's centres and thresholds, in units of ``n0``. ``None`` picks 1/4, plus 128
        rows.
      domain: the domain exchange buffers.
    """

    radius: float | None = None
    levels: int = 4
    pair_factor: float | None = None
    smooth_factor: float | None = None
    domain: DomainConfig = dataclasses.field(default_factory=DomainConfig)

    def __post_init__(self):
        _check_numbers(self)

    def pair_rows(self, n0: int) -> int:
        return _default_rows(
            1.0 if self.pair_factor is None else self.pair_factor, n0, self.pair_factor
        )

    def smooth_rows(self, n0: int) -> int:
        given = self.smooth_factor
        return _default_rows(0.25 if given is None else given, n0, given)


@dataclasses.dataclass(frozen=True)
class FoFConfig:
    """Friends-of-friends settings.

    Attributes:
      max_halos: catalogue rows per device, also the rows used to combine groups split
        across devices. ``None`` picks ``max(1024, n0 // 16)``.
      chunk_size: candidate pairs tested per pass. Memory is O(chunk_size), and the number
        of passes is (candidate pairs) / chunk_size. ``None`` picks half a device's rows
        (owned, ghosts and z images), which is also the least used: links are merged into
        the union-find forest, at O(rows) per merge, once per ``chunk_size`` links. On
        GPUs, where every pass has a fixed cost, a larger value can pay.
      domain: the domain exchange buffers.
      so: the spherical-overdensity search of ``fof(so=...)``. Leave its ``domain`` unset:
        ``domain`` above sizes the one decomposition, and ``fof`` refuses a nested one.
      knn: the kNN search of ``fof(centre="peak")`` (its ``domain`` likewise).
    """

    max_halos: int | None = None
    chunk_size: int | None = None
    domain: DomainConfig = dataclasses.field(default_factory=DomainConfig)
    so: SOConfig = dataclasses.field(default_factory=SOConfig)
    knn: KNNConfig = dataclasses.field(default_factory=KNNConfig)

    def __post_init__(self):
        _check_numbers(self)

    def halo_rows(self, n0: int) -> int:
        return self.max_halos if self.max_halos is not None else max(1024, n0 // 16)


@dataclasses.dataclass(frozen=True)
class MergerConfig:
    """The buffer of :func:`jaxpm_halos.merger_links`.

    Attributes:
      max_pairs: distinct (earlier halo, later halo) pairs one device can hold among its
        particles. ``None`` picks a quarter of the larger catalogue's rows per device
        (``max_halos``), at least 64: a halo's particles on one device rarely go to more
        than a few haloes (at 64^3 in 64 Mpc/h, z = 0, on 8 devices: 82 pairs at most, of
        512 rows). Outside ``jit`` it grows when too small.
    """

    max_pairs: int | None = None

    def __post_init__(self):
        _check_numbers(self)

    def pair_rows(self, halo_rows: int) -> int:
        return self.max_pairs if self.max_pairs is not None else max(64, halo_rows // 4)


@dataclasses.dataclass(frozen=True)
class Knob:
    """A config field that sizes a buffer, named as ``(class, field)``.

    Checked when the module is imported, so a renamed field fails at once rather than in
    an error message that suggests a setting that no longer exists.
    """

    owner: type
    field: str

    def __post_init__(self):
        if self.field not in {f.name for f in dataclasses.fields(self.owner)}:
            raise TypeError(f"{self.owner.__name__} has no field {self.field!r}")

    def __str__(self) -> str:
        return f"{self.owner.__name__}.{self.field}"


TRANSFER = Knob(DomainConfig, "transfer_factor")
CAPACITY = Knob(DomainConfig, "capacity_factor")
GHOSTS = Knob(DomainConfig, "ghost_factor")
IMAGES = Knob(DomainConfig, "image_factor")
MAX_HALOS = Knob(FoFConfig, "max_halos")
MAX_PAIRS = Knob(MergerConfig, "max_pairs")
REMOTE = Knob(KNNConfig, "remote_factor")
KNN_INDEX = Knob(KNNConfig, "index_factor")
SO_RADIUS = Knob(SOConfig, "radius")
SO_PAIRS = Knob(SOConfig, "pair_factor")
SO_SMOOTH = Knob(SOConfig, "smooth_factor")

# The decomposition's knobs: its buffers hold particle rows (or copies of them), and an
# earlier buffer's overflow only drops rows, so their needs are then lower bounds, never
# overshoots. They are grown in the same round as that earlier buffer (Status.failure). A
# derived count (halos, remote queries, SO pairs) can grow on truncated data, so it waits
# for the next round.
PARTICLE_KNOBS = frozenset({TRANSFER, CAPACITY, GHOSTS, IMAGES})
