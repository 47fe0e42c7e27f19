"""From the public API's inputs to per-device kernels, and back.

:func:`prepare` accepts positions ``(N, 3)`` or ``(nc, nc, nc, 3)``, or
:class:`~jaxpm_halos.Particles`, with optional velocities and masses, and reads the layout
from the input. :func:`local_fields` runs on each device and flattens its block into rows
with global ids: the input index for flat input, the lattice index for JaxPM grids.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ._geometry import wrap
from ._layout import Layout, layout_of
from ._particles import Particles, _check_box_size
from ._status import InvalidInputError

int32 = jnp.int32

_program_caches = []


def program_cache(maxsize: int):
    """``functools.lru_cache`` for jitted programs, emptied by :func:`clear_caches`."""

    def decorate(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _program_caches.append(cached)
        return cached

    return decorate


def clear_caches():
    """Drop every compiled jaxpm_halos program (and ``jax.clear_caches()``).

    Each XLA:CPU executable holds a few memory maps of JIT code. A long-lived process that
    compiles hundreds of distinct programs (many box sizes, linking lengths, meshes) can reach
    the kernel's ``vm.max_map_count`` (65530 by default) and crash inside the compiler; call
    this between unrelated batches of work to release them.
    """
    for cached in _program_caches:
        cached.cache_clear()
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
        particles = pos
        box_size = particles.box_size if box_size is None else box_size
        vel = particles.vel if vel is None else vel
        mass = particles.mass if mass is None else mass
        ids, pos = particles.id, particles.pos
    if box_size is None:
        raise ValueError("box_size is required for position arrays")
    box_size = _check_box_size(box_size)
    pos = _at_least_float32(pos)
    if vel is not None:
        vel = _at_least_float32(vel)
    pos = _screen_masses(mass, pos)
    layout = layout_of(pos, box_size, mesh)
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
        if isinstance(mass, (int, float, np.number)) or (not isinstance(mass, jax.core.Tracer)
                                                          and np.ndim(mass) == 0):
            static_mass = float(mass)
        elif np.ndim(mass) == 0:
            mass_kind = "scalar"
            args.append(jnp.asarray(mass, pos.dtype))
            specs.append(P())
        else:
            mass = _at_least_float32(mass)
            if tuple(mass.shape) != tuple(pos.shape[:-1]):
                raise ValueError(f"mass must be a scalar or of shape {pos.shape[:-1]}, "
                                 f"got {mass.shape}")
            mass_kind = "rows"
            args.append(mass)
            specs.append(spec)
    if layout.num_particles is not None:
        # Rows of zeros, masked out on the devices (:func:`local_valid`); a scalar mass
        # (spec P()) has no rows.
        rows = layout.shape[0] - layout.num_particles
        args = [a if s == P() else jnp.concatenate([a, jnp.zeros((rows,) + a.shape[1:], a.dtype)])
                for a, s in zip(args, specs)]
    problem = Problem(layout, box_size, vel is not None, ids is not None, mass_kind, static_mass)
    return problem, tuple(args), tuple(specs)


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
        raise InvalidInputError(f"jaxpm_halos: {count} particle masses are NaN, inf or "
                                "negative; masses must be finite and >= 0.")
    return pos


def _at_least_float32(x):
    """An array-like as an array computed in float32 at least: integer and half-precision
    (float16, bfloat16) input is converted to float32, wider floats pass unchanged."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits >= 32:
        return x
    return jnp.asarray(x, jnp.float32)


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
    fields["id"] = (blocks.pop(0).reshape(-1).astype(int32) if problem.has_ids
                    else _default_ids(problem, block_shape))
    n = fields["pos"].shape[0]
    if problem.mass_kind == "rows":
        fields["mass"] = blocks.pop(0).reshape(-1).astype(pos.dtype)
    elif problem.mass_kind == "scalar":
        fields["mass"] = jnp.broadcast_to(blocks.pop(0), (n,))
    return fields, block_shape


def particle_fields(particles: Particles) -> dict:
    """Row fields (``pos`` wrapped, ``id``, ``mass``, and ``vel`` when present) of one
    device's :class:`~jaxpm_halos.Particles`, for the local APIs."""
    fields = {"pos": wrap(particles.pos.reshape(-1, 3), particles.box_size),
              "id": particles.id.reshape(-1), "mass": particles.masses()}
    if particles.vel is not None:
        fields["vel"] = particles.vel.reshape(-1, 3)
    return fields


def particles_of(migrated, box_size: float) -> Particles:
    """The :class:`~jaxpm_halos.Particles` a device owns after migration (valid first)."""
    payload = migrated.payload
    return Particles(payload["pos"], payload["id"], migrated.count, payload.get("vel"),
                     payload["mass"], box_size)


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
