"""From the public API's inputs to per-device kernels, and back.

:func:`prepare` accepts positions ``(N, 3)`` or ``(nc, nc, nc, 3)``, or
:class:`~jaxpm_halos.Particles`, with optional velocities and masses, and reads the layout
from the input. :func:`local_fields` runs on each device and flattens its block into rows
with global ids: the input index for flat input, the lattice index for JaxPM grids.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .errors import invalid_input
from .geometry import wrap
from .layout import Layout, layout_of
from .particles import Particles, _check_box_size, check_real, check_row_count, real_floats
from .status import is_traced

int32 = jnp.int32

# Each XLA:CPU executable keeps its JIT code in memory maps: measured with jax 0.7.2 on 8
# host CPU devices, 1,550 (FoF, one device) to 2,700 (kNN, mesh (2, 4), 64^3) per program and
# 4,100 for an InSitu program. Linux stops a process at vm.max_map_count maps (65,530 by
# default), where XLA's compiler fails ("LLVM compilation error: Cannot allocate memory") or
# crashes. So all jaxpm_halos programs share one LRU whose programs together hold at most
# MAP_SHARE of that limit, the rest being left to JAX and the caller's own programs.
MAP_SHARE = 0.5
_MAPS_ESTIMATE = 2_700  # a program not yet measured (the largest FoF or kNN one above)
_DEFAULT_MAX_MAPS = 65_530  # Linux's default, where /proc/sys/vm/max_map_count is unreadable


def maps_in_use() -> int | None:
    """Memory maps of this process (lines of /proc/self/maps), or None where unreadable."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def max_map_count() -> int:
    """The kernel's limit on memory maps per process (Linux), else Linux's default."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return _DEFAULT_MAX_MAPS


class _Program:
    """A cached jitted program; its first call outside a trace (the one that compiles it)
    records how many memory maps the compilation added."""

    def __init__(self, jitted, cache: ProgramCache):
        self.jitted = jitted
        self.cache = cache
        self.maps = None

    def __call__(self, *args):
        if self.maps is not None or any(
            isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(args)
        ):
            return self.jitted(*args)
        before = maps_in_use()
        out = self.jitted(*args)
        after = maps_in_use()
        self.maps = _MAPS_ESTIMATE if before is None else max(after - before, 0)
        self.cache.fit()
        return out

    @property
    def weight(self) -> int:
        return _MAPS_ESTIMATE if self.maps is None else self.maps


class ProgramCache:
    """One LRU of jitted programs for all of jaxpm_halos, bounded by the memory maps they
    hold (``max_maps``, default ``MAP_SHARE`` of ``vm.max_map_count``) and per function.

    Dropping a program here frees its maps: JAX keeps its executables in caches of the
    ``jax.jit`` object, which only this cache references (measured: evicting five FoF
    programs released their 10,820 maps), and ``clear_cache()`` empties them at once.
    """

    def __init__(self, max_maps: int | None = None):
        self.max_maps = max_maps
        self.entries = collections.OrderedDict()  # (function, args) -> _Program, oldest first

    def budget(self) -> int:
        return self.max_maps if self.max_maps is not None else int(MAP_SHARE * max_map_count())

    def get(self, fn, maxsize: int, args, kwargs):
        key = (fn, args, tuple(sorted(kwargs.items())))
        program = self.entries.pop(key, None)
        if program is None:
            own = [k for k in self.entries if k[0] is fn]
            for old in own[: max(len(own) - maxsize + 1, 0)]:
                self.drop(old)
            program = _Program(fn(*args, **kwargs), self)
        self.entries[key] = program  # most recently used last
        self.fit()
        return program

    def fit(self):
        """Drop the least recently used programs until the rest fit the budget (the newest
        is always kept)."""
        budget = self.budget()
        while len(self.entries) > 1 and sum(p.weight for p in self.entries.values()) > budget:
            self.drop(next(iter(self.entries)))

    def drop(self, key):
        program = self.entries.pop(key)
        program.jitted.clear_cache()

    def clear(self):
        for key in list(self.entries):
            self.drop(key)


_PROGRAMS = ProgramCache()


def program_cache(maxsize: int):
    """Cache a function that builds a jitted program from hashable arguments in the shared
    :class:`ProgramCache`, keeping at most ``maxsize`` of its programs."""

    def decorate(fn):
        @functools.wraps(fn)
        def cached(*args, **kwargs):
            return _PROGRAMS.get(fn, maxsize, args, kwargs)

        return cached

    return decorate


def clear_caches():
    """Drop every compiled jaxpm_halos program (and ``jax.clear_caches()``).

    Compiled programs hold memory maps of JIT code (about 1,500 to 4,100 each). jaxpm_halos
    keeps its own within half of the kernel's ``vm.max_map_count`` (see :class:`ProgramCache`);
    call this to release them all, e.g. before compiling many programs of your own.
    """
    _PROGRAMS.clear()
    jax.clear_caches()


@dataclasses.dataclass(frozen=True)
class Problem:
    """Static description of one call: layout, box and which optional fields exist."""

    layout: Layout
    box_size: float
    has_vel: bool
    has_ids: bool
    mass_kind: str  # "static", "scalar" (replicated array) or "rows"
    static_mass: float = 1.0

    @property
    def pencils(self):
        return self.layout.pencils

    @property
    def total(self) -> int:
        """Particles in the input (padding appended by :func:`prepare` excluded)."""
        if self.layout.num_particles is not None:
            return self.layout.num_particles
        return int(np.prod(self.layout.shape))

    @property
    def mean_separation(self) -> float:
        return self.box_size / self.total ** (1 / 3)


def prepare(pos, box_size=None, vel=None, mass=None, mesh=None):
    """Normalise inputs. Returns ``(problem, args, in_specs)`` for :meth:`Layout.run`.

    Positions, velocities and per-particle masses may be any array-like; integer and
    half-precision (float16, bfloat16) values are computed in float32. Masses must be
    finite and >= 0 (see :func:`_screen_masses`).
    """
    ids = None
    if isinstance(pos, Particles):
        particles = _dense(pos)
        if box_size is not None and not math.isclose(
            _check_box_size(box_size), float(particles.box_size), rel_tol=1e-6
        ):
            # The positions were wrapped into the Particles' box: searching another box
            # would give plausible wrong groups and densities. (The same box in float32
            # and float64 is the same box.)
            raise ValueError(
                f"box_size={box_size} disagrees with the Particles' box_size="
                f"{particles.box_size}; leave box_size out (it is taken from "
                "the Particles) or build the Particles with the box you mean"
            )
        box_size = particles.box_size
        vel = particles.vel if vel is None else vel
        mass = particles.mass if mass is None else mass
        ids, pos = particles.id, particles.pos
    if box_size is None:
        raise ValueError("box_size is required for position arrays")
    box_size = _check_box_size(box_size)
    pos = real_floats(pos, "positions")
    if vel is not None:
        vel = real_floats(vel, "vel")
    pos = _screen_masses(mass, pos)
    layout = layout_of(pos, box_size, mesh)
    check_row_count(int(np.prod(layout.shape)))  # before padding rows are appended
    spec = layout.spec
    vector_spec = P(*spec, None) if layout.grid else P(spec[0] if len(spec) else None, None)
    args, specs = [pos], [vector_spec]
    if vel is not None:
        if tuple(vel.shape) != tuple(pos.shape):
            raise ValueError(f"vel must have the shape of pos {pos.shape}, got {vel.shape}")
        args.append(vel)
        specs.append(vector_spec)
    if ids is not None:
        args.append(ids)
        specs.append(spec)
    mass_kind, static_mass = "static", 1.0
    if mass is not None:
        check_real(mass, "mass")
        if isinstance(mass, (int, float, np.number)) or (
            not isinstance(mass, jax.core.Tracer) and np.ndim(mass) == 0
        ):
            static_mass = float(mass)
        elif np.ndim(mass) == 0:
            mass_kind = "scalar"
            args.append(jnp.asarray(mass, pos.dtype))
            specs.append(P())
        else:
            mass = real_floats(mass, "mass")
            if tuple(mass.shape) != tuple(pos.shape[:-1]):
                raise ValueError(
                    f"mass must be a scalar or of shape {pos.shape[:-1]}, got {mass.shape}"
                )
            mass_kind = "rows"
            args.append(mass)
            specs.append(spec)
    if layout.num_particles is not None:
        # Rows of zeros, masked out on the devices (:func:`local_valid`); a scalar mass
        # (spec P()) has no rows.
        rows = layout.shape[0] - layout.num_particles
        args = [
            a if s == P() else jnp.concatenate([a, jnp.zeros((rows,) + a.shape[1:], a.dtype)])
            for a, s in zip(args, specs)
        ]
    problem = Problem(layout, box_size, vel is not None, ids is not None, mass_kind, static_mass)
    return problem, tuple(args), tuple(specs)


def _dense(particles: Particles) -> Particles:
    """``particles``, which the public calls take row for row (every row a particle):
    padded ones (``num`` below their rows, e.g. from ``Particles.create(num=...)``) raise
    outside ``jit``. Inside, ``num`` may not be known: rows at or after it get NaN
    positions, so they are left out and counted like non-finite ones (the status fails)
    rather than read as particles at the origin."""
    num = particles.num
    if is_traced((num,)):
        padding = ~particles.valid().reshape(particles.shape)
        return dataclasses.replace(
            particles,
            pos=jnp.where(
                padding[..., None], jnp.asarray(jnp.nan, particles.pos.dtype), particles.pos
            ),
        )
    if int(num) != particles.size:
        raise ValueError(
            f"these Particles hold {int(num)} particles in {particles.size} rows (the rows "
            f"from {int(num)} on are padding), but the public calls take every row as a "
            "particle. Pass the valid rows, e.g. Particles.create(p.pos[:p.num], "
            "p.box_size, id=p.id[:p.num], mass=...), or a position array"
        )
    return particles


def _screen_masses(mass, pos):
    """Masses must be finite and >= 0. Concrete ones are checked here; traced ones cannot
    be, so their particles get NaN positions: the devices exclude them and count them
    with the non-finite positions (``Status.nonfinite``, ``status.ok`` False)."""
    if mass is None:
        return pos
    if isinstance(mass, jax.core.Tracer):
        if mass.ndim and tuple(mass.shape) != tuple(pos.shape[:-1]):
            return pos  # prepare names the shape
        bad = ~(jnp.isfinite(mass) & (mass >= 0))
        return jnp.where(bad[..., None], jnp.asarray(jnp.nan, pos.dtype), pos)
    xp = jnp if isinstance(mass, jax.Array) else np
    m = xp.asarray(mass)
    count = int(xp.sum(~(xp.isfinite(m) & (m >= 0))))
    if count:
        raise invalid_input(
            f"jaxpm_halos: {count} particle masses are NaN, inf or "
            "negative; masses must be finite and >= 0.",
            count,
        )
    return pos


def local_fields(problem: Problem, *blocks):
    """Flatten one device's input blocks into row fields.

    Returns ``(fields, block_shape)`` with ``fields`` holding ``pos`` (wrapped), ``id`` and,
    when given, ``vel`` and ``mass`` (per row).
    """
    blocks = list(blocks)
    pos = blocks.pop(0)
    block_shape = pos.shape[:-1]
    fields = {"pos": wrap(pos.reshape(-1, 3), problem.box_size)}
    if problem.has_vel:
        fields["vel"] = blocks.pop(0).reshape(-1, 3)
    fields["id"] = (
        blocks.pop(0).reshape(-1).astype(int32)
        if problem.has_ids
        else _default_ids(problem, block_shape)
    )
    n = fields["pos"].shape[0]
    if problem.mass_kind == "rows":
        fields["mass"] = blocks.pop(0).reshape(-1).astype(pos.dtype)
    elif problem.mass_kind == "scalar":
        fields["mass"] = jnp.broadcast_to(blocks.pop(0), (n,))
    return fields, block_shape


def particle_fields(particles: Particles) -> dict:
    """Row fields (``pos`` wrapped, ``id``, ``mass``, and ``vel`` when present) of one
    device's :class:`~jaxpm_halos.Particles`, for the local APIs."""
    fields = {
        "pos": wrap(particles.pos.reshape(-1, 3), particles.box_size),
        "id": particles.id.reshape(-1),
        "mass": particles.masses(),
    }
    if particles.vel is not None:
        fields["vel"] = particles.vel.reshape(-1, 3)
    return fields


def particles_of(migrated, box_size: float) -> Particles:
    """The :class:`~jaxpm_halos.Particles` a device owns after migration (valid first)."""
    payload = migrated.payload
    return Particles(
        payload["pos"], payload["id"], migrated.count, payload.get("vel"), payload["mass"], box_size
    )


def local_valid(problem: Problem, rows: int):
    """(rows,) bool: this device's input rows that hold particles (not :func:`prepare`'s
    padding)."""
    num = problem.layout.num_particles
    if num is None:
        return jnp.ones(rows, bool)
    return problem.pencils.device_index() * rows + jnp.arange(rows, dtype=int32) < num


def trim_padding(problem: Problem, tree):
    """Per-particle outputs without the rows :func:`prepare` appended."""
    num = problem.layout.num_particles
    return tree if num is None else jax.tree.map(lambda a: a[:num], tree)


def _default_ids(problem: Problem, block_shape):
    pencils = problem.pencils
    if len(block_shape) == 1:
        n = block_shape[0]
        return pencils.device_index() * n + jnp.arange(n, dtype=int32)
    bx, by, nc = block_shape
    i, j = pencils.coords()
    ix = i * bx + jnp.arange(bx, dtype=int32)[:, None, None]
    iy = j * by + jnp.arange(by, dtype=int32)[None, :, None]
    iz = jnp.arange(nc, dtype=int32)[None, None, :]
    return ((ix * nc + iy) * nc + iz).reshape(-1)


def row_masses(problem: Problem, fields):
    """Per-row masses after migration (the static mass when masses are uniform)."""
    if "mass" in fields:
        return fields["mass"]
    return jnp.full(fields["pos"].shape[0], problem.static_mass, fields["pos"].dtype)
