"""Where the particles live: mesh, axis names and spec, read from the input.

A :class:`Pencils` is the static description of the spatial decomposition used inside
``shard_map``: the box is cut into ``px x py`` pencils along x and y (z is never cut), and
pencil ``(i, j)`` belongs to the device at mesh coordinates ``(i, j)`` of the two mesh axes
``x_axis`` and ``y_axis``. Axis names always come from the caller's mesh or the input's
sharding; an axis of size one is recorded as ``None`` and needs no communication.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .status import is_traced


def _check_cutting_axes(axes, independent) -> None:
    """Raise when the caller's ``shard_map`` splits the particles over a manual mesh axis
    (of size > 1) that is neither named in ``axes`` nor declared ``independent``: each
    device would take its own rows for the whole pencil, and search and link without the
    others', with an ok status."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = getattr(mesh, "manual_axes", ())
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    unnamed = [a for a in manual if sizes[a] > 1 and a not in axes and a not in independent]
    if unnamed:
        raise ValueError(
            f"the shard_map splits the particles over mesh axes {unnamed} that axes={tuple(axes)} "
            "does not name, so each device would see only part of its pencil. Name the axes "
            "that cut the box along x and y in axes=, or, when each index along an axis "
            f"holds a separate simulation, pass independent_axes={tuple(unnamed)}"
        )


@dataclasses.dataclass(frozen=True)
class Pencils:
    """Static pencil decomposition of a periodic box over (up to) two mesh axes."""

    x_axis: str | None
    y_axis: str | None
    px: int
    py: int
    box_size: float

    @classmethod
    def from_axes(cls, axes, box_size: float, independent=()) -> Pencils:
        """The pencils of the caller's mesh axes ``(x_axis, y_axis)`` (None where the box
        is not cut), inside the caller's ``shard_map``; ``independent``: its other manual
        axes, along which each index holds a separate problem (see
        :func:`_check_cutting_axes`)."""
        _check_cutting_axes(axes, independent)
        x_axis, y_axis = axes
        px = jax.lax.axis_size(x_axis) if x_axis else 1
        py = jax.lax.axis_size(y_axis) if y_axis else 1
        return cls(x_axis if px > 1 else None, y_axis if py > 1 else None, px, py, box_size)

    @property
    def num_devices(self) -> int:
        return self.px * self.py

    @property
    def widths(self) -> tuple[float, float]:
        """Pencil side lengths along x and y."""
        return self.box_size / self.px, self.box_size / self.py

    def coords(self):
        """This device's pencil coordinates ``(i, j)`` (traced int32 scalars)."""
        i = jax.lax.axis_index(self.x_axis) if self.x_axis else jnp.int32(0)
        j = jax.lax.axis_index(self.y_axis) if self.y_axis else jnp.int32(0)
        return jnp.int32(i), jnp.int32(j)

    def device_index(self):
        """Linear device index ``i * py + j``: the row-major order of ``P((x_axis, y_axis))``."""
        i, j = self.coords()
        return i * self.py + j

    def block_of(self, pos):
        """Pencil coordinates ``(i, j)`` owning each position (wrapped into the box)."""
        wx, wy = self.widths
        i = jnp.clip(jnp.floor(pos[..., 0] / wx).astype(jnp.int32), 0, self.px - 1)
        j = jnp.clip(jnp.floor(pos[..., 1] / wy).astype(jnp.int32), 0, self.py - 1)
        return i, j

    def bounds(self):
        """Lower and upper corners (x, y) of this device's pencil, float32 arrays of shape (2,)."""
        i, j = self.coords()
        wx, wy = self.widths
        lo = jnp.stack([i * jnp.float32(wx), j * jnp.float32(wy)])
        hi = jnp.stack([(i + 1) * jnp.float32(wx), (j + 1) * jnp.float32(wy)])
        return lo, hi


def width_fraction(pencils: Pencils, width: float) -> float:
    """A layer width as a fraction of the narrower pencil side (sizes ghost buffers)."""
    return float(width) / min(pencils.widths)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a global particle array is laid out over devices.

    Attributes:
      mesh: the device mesh (concrete or abstract), or None for a single device.
      pencils: the spatial decomposition that follows the mesh.
      shape: the leading shape of the particle arrays, ``(N,)`` or ``(nc, nc, nc)``; for
        flat input that the devices cannot split evenly, N rounded up to a multiple of the
        device count.
      spec: the PartitionSpec of the leading axes.
      num_particles: the input's particle count N when ``shape`` was rounded up: rows from
        N on are padding, appended by :func:`~.frontend.prepare`. None otherwise.
    """

    mesh: object
    pencils: Pencils
    shape: tuple[int, ...]
    spec: P
    num_particles: int | None = None

    @property
    def grid(self) -> bool:
        return len(self.shape) == 3

    @property
    def local_size(self) -> int:
        """Particles per device in the input layout (``n0``)."""
        size = 1
        for s in self.shape:
            size *= s
        return size // self.pencils.num_devices

    @property
    def device_spec(self) -> P:
        """Spec of per-device outputs stacked along axis 0 (catalogue rows, counts)."""
        axes = tuple(a for a in (self.pencils.x_axis, self.pencils.y_axis) if a)
        return P(axes) if axes else P()

    def run(self, fn: Callable, args, in_specs, out_specs):
        """Run ``fn`` per device (``shard_map``), or directly when there is one device."""
        if self.mesh is None:
            return fn(*args)
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )(*args)


def layout_of(pos, box_size: float, mesh=None) -> Layout:
    """Read the layout of a position array ``(N, 3)`` or ``(nc, nc, nc, 3)``.

    The mesh is, in order: ``mesh``; the input's ``NamedSharding``; the abstract mesh of a
    traced input; none (one device). Grids must be sharded over their first two axes,
    flat arrays over axis 0.
    """
    shape = tuple(pos.shape)
    if (
        len(shape) not in (2, 4)
        or shape[-1] != 3
        or (len(shape) == 4 and not shape[0] == shape[1] == shape[2])
    ):
        raise ValueError(f"positions must have shape (N, 3) or (nc, nc, nc, 3), got {shape}")
    return leading_layout(pos, shape[:-1], box_size, mesh)


def leading_layout(x, leading: tuple, box_size: float, mesh=None) -> Layout:
    """:func:`layout_of` for an array ``x`` whose leading axes ``leading`` (``(N,)`` or
    ``(nc, nc, nc)``) index particles, e.g. FoF labels."""
    grid = len(leading) == 3
    spec = None
    if mesh is None:
        sharding = None if is_traced(x) else getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            mesh, spec = sharding.mesh, sharding.spec
        elif is_traced(x):
            abstract = jax.typeof(x).sharding.mesh
            if abstract.size > 1:
                mesh = abstract
    if mesh is None or mesh.size == 1:
        return Layout(None, Pencils(None, None, 1, 1, box_size), leading, P())
    names = tuple(mesh.axis_names)
    if len(names) > 2:
        raise ValueError(
            f"jaxpm_halos decomposes the box over at most two mesh axes; the mesh "
            f"has {len(names)}: {dict(mesh.shape)}"
        )
    x_axis, y_axis = _axes_from_spec(spec, names, grid)
    sizes = dict(mesh.shape)
    px = sizes[x_axis] if x_axis else 1
    py = sizes[y_axis] if y_axis else 1
    if px * py != mesh.size:
        raise ValueError(
            f"the particles must be sharded over every mesh axis; spec {spec} "
            f"leaves part of mesh {sizes} replicated"
        )
    pencils = Pencils(x_axis if px > 1 else None, y_axis if py > 1 else None, px, py, box_size)
    if grid:
        nc = leading[0]
        if nc % px or nc % py:
            raise ValueError(f"grid side {nc} is not divisible by the mesh shape ({px}, {py})")
        return Layout(mesh, pencils, leading, P(x_axis, y_axis))
    spec = P(tuple(a for a in (x_axis, y_axis) if a))
    n = leading[0]
    # A sharded array always splits evenly; unsharded input is padded to fit the devices.
    padded = -(-n // mesh.size) * mesh.size
    return Layout(mesh, pencils, (padded,), spec, None if padded == n else n)


def _axes_from_spec(spec, names, grid):
    """Mesh axes cutting x and y, from the input's spec (or the canonical one)."""
    if spec is None:
        return names[0], (names[1] if len(names) > 1 else None)
    entries = tuple(spec) + (None,) * 4
    if grid:
        if any(e is not None for e in entries[2:]):
            raise ValueError(
                f"a JaxPM grid must be sharded over its first two axes only "
                f"(like P('x', 'y')); got {spec}"
            )
        x, y = (_single_axis(e, spec) for e in entries[:2])
        return x, y
    if any(e is not None for e in entries[1:]):
        raise ValueError(f"flat (N, 3) positions must be sharded along axis 0 only; got {spec}")
    first = entries[0]
    axes = (first,) if isinstance(first, str) else tuple(first or ())
    if len(axes) > 2:
        raise ValueError(f"at most two mesh axes may shard the particles; got {spec}")
    return (axes + (None, None))[:2]


def _single_axis(entry, spec):
    if entry is None or isinstance(entry, str):
        return entry
    if len(entry) == 1:
        return entry[0]
    raise ValueError(
        f"each of the grid's first two axes must be sharded over one mesh axis; got {spec}"
    )
