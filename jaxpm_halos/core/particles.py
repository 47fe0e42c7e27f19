"""The particle data model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .geometry import wrap


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Particles:
    """Particles in a periodic box, padded to a fixed number of rows.

    Shapes use ``S`` for the leading shape: ``(n,)`` for a flat set, or ``(nc, nc, nc)`` for
    a JaxPM lattice (see :func:`jaxpm_halos.from_jaxpm`).

    Attributes:
      pos: ``S + (3,)`` float positions, wrapped into ``[0, box_size)``, in the same length
        unit as ``box_size``.
      id: ``S`` int32 global particle id; ``-1`` in padding rows.
      num: scalar int32, the number of valid rows.
      vel: ``S + (3,)`` velocities, or ``None``.
      mass: scalar or ``S`` per-particle masses (default 1).
      box_size: side of the periodic box (static).

    Padding convention: for flat particles the valid rows come first, rows ``[num:]`` are
    padding with ``id == -1``, zero position, velocity and mass. Padding never takes part
    in any result: every kernel masks on ``arange(n) < num``. Global particles (the inputs
    and outputs of the public API) are dense: ``num`` equals their size.
    """

    pos: jax.Array
    id: jax.Array
    num: jax.Array
    vel: jax.Array | None = None
    mass: jax.Array | float = 1.0
    box_size: float = dataclasses.field(default=1.0, metadata=dict(static=True))

    @classmethod
    def create(cls, pos, box_size, *, id=None, vel=None, mass=1.0, num=None) -> Particles:
        """Build particles, wrapping ``pos`` into the box.

        ``id`` defaults to the C-order row index and ``num`` to all rows. Rows at or after
        ``num`` are turned into padding.

        Given ids must be integers in ``[0, 2**31 - 2]`` with the positions' leading shape
        (-1 marks padding and ``2**31 - 1`` "no id" inside the kernels), and unique: FoF
        labels a group by its smallest id. Outside ``jit`` other ids raise ``ValueError``,
        and so do repeated ones given as a host (numpy) array; FoF finds repeats in ids
        already on devices (``status.repeated_ids``, which fails the status), except on a
        ``(nc, nc, nc)`` grid, whose ids it takes to be the lattice's, unique by
        construction (:func:`~jaxpm_halos.from_jaxpm`'s). Inside ``jit`` nothing can
        raise: a particle whose id lies outside that range gets a NaN position, so the
        analyses leave it out and count it in ``status.nonfinite`` (the status fails)
        rather than label groups or neighbours by a wrapped or padding id. Relabel unique
        ids with ``np.unique(ids, return_inverse=True)`` and map the results back.
        """
        box_size = _check_box_size(box_size)
        pos = jnp.asarray(real_floats(pos, "positions"))
        if pos.shape[-1:] != (3,):
            raise ValueError(f"positions must have a trailing axis of size 3, got {pos.shape}")
        shape = pos.shape[:-1]
        size = int(jnp.size(pos) // 3)
        num = _checked_num(num, size)
        _check_row_field("vel", vel, shape + (3,))
        _check_row_field("mass", mass, shape if np.ndim(mass) else ())
        if id is None:
            id = jnp.arange(size, dtype=jnp.int32).reshape(shape)
        else:
            id, checked = _checked_ids(id, shape, size if num is None else num)
            if not checked:
                pos = _leave_out_unusable_ids(pos, id)
        dense = num is None
        particles = cls(
            wrap(pos, box_size),
            jnp.asarray(id, jnp.int32),
            jnp.asarray(size if dense else num, jnp.int32),
            None if vel is None else jnp.asarray(vel, pos.dtype),
            mass,
            box_size,
        )
        return particles if dense else particles.masked()

    @property
    def shape(self) -> tuple[int, ...]:
        """The leading shape ``S``."""
        return self.pos.shape[:-1]

    @property
    def size(self) -> int:
        return int(jnp.size(self.id))

    def valid(self) -> jax.Array:
        """Bool mask over the flattened rows: True for real particles."""
        return jnp.arange(self.size) < self.num

    def masses(self) -> jax.Array:
        """Per-row masses (zero in padding), flattened."""
        mass = jnp.broadcast_to(jnp.asarray(self.mass, self.pos.dtype), self.shape).reshape(-1)
        return jnp.where(self.valid(), mass, 0)

    def masked(self) -> Particles:
        """Set padding rows to the padding convention (id -1, zeros)."""
        valid = self.valid().reshape(self.shape)
        zero = lambda a: None if a is None else jnp.where(valid[..., None], a, 0)
        mass = self.mass
        if jnp.ndim(mass):
            mass = jnp.where(valid, mass, 0)
        return dataclasses.replace(
            self,
            pos=zero(self.pos),
            vel=zero(self.vel),
            id=jnp.where(valid, self.id, -1),
            mass=mass,
        )


def check_real(x, name: str) -> None:
    """Raise unless ``x`` (an array, a Python or numpy scalar) holds integers or floats."""
    dtype = np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
    if dtype.kind not in "iuf" and dtype != jnp.bfloat16:
        raise ValueError(f"{name} must hold real numbers, got dtype {dtype}")


def real_floats(x, name: str):
    """An array-like as an array of real floats, float32 at least: integer and
    half-precision (float16, bfloat16) input becomes float32, wider floats pass unchanged.
    Booleans (a mask passed by mistake), complex numbers and strings raise, naming the
    argument ``name``."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    check_real(x, name)
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits >= 32:
        return x
    return jnp.asarray(x, jnp.float32)


INT32_MAX = int(np.iinfo(np.int32).max)
ID_MAX = INT32_MAX - 1  # the int32 maximum marks "no id" in the kernels


def _checked_num(num, size: int):
    """``num`` refused unless an integer in ``[0, size]``; a traced one passes unchecked."""
    if num is None or isinstance(num, jax.core.Tracer):
        return num
    return _check_integer("num (the number of valid rows)", num, 0, size)


def _check_row_field(name: str, value, shape: tuple) -> None:
    """Raise unless the field ``value`` (or None) holds real numbers of ``shape``: a
    broadcast or a truncation would pair rows with the wrong particles, and a string or
    complex value would fail (or be cast) far from here."""
    if value is None:
        return
    check_real(value, name)
    if tuple(np.shape(value)) != tuple(shape):
        raise ValueError(
            f"{name} must have shape {tuple(shape)} (the positions' rows), "
            f"got {tuple(np.shape(value))}"
        )


def _checked_ids(id, shape, num):
    """Ids refused unless integers of ``shape`` whose first ``num`` rows (the valid ones)
    lie in ``[0, ID_MAX]``, and unique when given on the host (see ``Particles.create``).
    Returns them and whether their values were checked: traced ids or ``num``, and any
    inside a trace, are not (nothing can raise there; see :func:`_leave_out_unusable_ids`)."""
    on_host = not isinstance(id, jax.Array)
    ids = np.asarray(id) if on_host else id
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"particle ids must be integers, got dtype {ids.dtype}")
    if tuple(ids.shape) != tuple(shape):
        raise ValueError(
            f"particle ids must have the positions' leading shape {shape}, got {ids.shape}"
        )
    if isinstance(ids, jax.core.Tracer) or isinstance(num, jax.core.Tracer):
        return ids, False
    if ids.size == 0:
        return ids, True
    if on_host:
        rows = ids.reshape(-1)[: max(int(num), 0)]
        lo, hi = (rows.min(), rows.max()) if rows.size else (0, 0)
    else:
        lo, hi = _valid_id_range(ids, num)
        if isinstance(lo, jax.core.Tracer):  # inside a user's trace
            return ids, False
    if int(lo) < 0 or int(hi) > ID_MAX:
        raise ValueError(
            f"particle ids must lie in [0, {ID_MAX}] (int32; -1 marks padding), "
            f"got ids from {int(lo)} to {int(hi)}. Relabel them, e.g. "
            "np.unique(ids, return_inverse=True), and map the results back"
        )
    if on_host and np.unique(rows).size < rows.size:
        raise ValueError(
            "particle ids must be unique (FoF labels a group by its smallest "
            "id), but some repeat. Leave id out to number the rows, or pass "
            "id=np.arange(len(ids)) and keep your ids beside them"
        )
    return ids, True


def _leave_out_unusable_ids(pos, ids):
    """``pos`` with NaN rows where ``ids`` (unchecked: traced) lie outside ``[0, ID_MAX]``,
    compared in their own dtype before the cast to int32 could wrap them: the analyses
    leave such particles out and count them as unusable (``status.nonfinite``)."""
    limits = jnp.iinfo(ids.dtype)
    bad = jnp.zeros(ids.shape, bool)
    if limits.min < 0:
        bad |= ids < 0
    if limits.max > ID_MAX:  # ID_MAX itself would wrap in a narrower dtype
        bad |= ids > jnp.asarray(ID_MAX, ids.dtype)
    return jnp.where(bad[..., None], jnp.asarray(jnp.nan, pos.dtype), pos)


@jax.jit
def _valid_id_range(ids, num):
    """Smallest and largest of the first ``num`` ids (C order), reduced where the ids are:
    flattening or slicing a sharded array would copy it onto each device."""
    valid = jnp.arange(ids.size).reshape(ids.shape) < num
    limits = jnp.iinfo(ids.dtype)  # no valid row: an empty range, lo > hi
    # the limits in the ids' own dtype: a Python int beyond int32 (uint32's max) overflows
    top, bottom = jnp.asarray(limits.max, ids.dtype), jnp.asarray(limits.min, ids.dtype)
    return (jnp.min(jnp.where(valid, ids, top)), jnp.max(jnp.where(valid, ids, bottom)))


def _check_box_size(box_size) -> float:
    if isinstance(box_size, jax.core.Tracer):  # it sizes the pencils and the cell grid
        raise TypeError(
            "box_size must be a Python number (static), not a traced value: inside jit, "
            "close over it (jax.jit(lambda p: fof(p, box_size=10.0, ...))) or mark the "
            "argument static (jax.jit(f, static_argnames='box_size'))"
        )
    if np.ndim(box_size) != 0 or isinstance(box_size, (bool, np.bool_, str)):
        raise ValueError(
            f"box_size must be one number, the side of a cubic periodic box "
            f"(non-cubic boxes are not supported), got {box_size!r}"
        )
    box_size = float(box_size)
    if not box_size > 0 or box_size != box_size or box_size == float("inf"):
        raise ValueError(f"box_size must be a positive finite length, got {box_size}")
    return box_size


def check_row_count(rows: int) -> None:
    """Particle ids, row indices and counts are int32 on the devices: more rows would wrap
    them (a default lattice id past 2**31 - 1 turns negative) and mislabel groups and
    neighbours with no sign. Refused before anything is traced, as is an empty input."""
    if rows < 1:
        raise ValueError(
            "no particles: the positions hold 0 rows, and at least 1 particle is needed "
            "(kNN needs k + 1); pass a non-empty (N, 3) array"
        )
    if rows > INT32_MAX:
        raise ValueError(
            f"{rows} particle rows: jaxpm_halos numbers particles and rows in "
            f"int32, so at most 2**31 - 1 = {INT32_MAX} fit (nc <= 1290 on a "
            "JaxPM grid)"
        )


def check_scale_factor(a) -> None:
    """Raise unless the scale factor ``a`` is positive and finite (a traced value passes:
    nothing can raise inside ``jit``)."""
    if not isinstance(a, jax.core.Tracer) and not np.all(np.isfinite(a) & (np.asarray(a) > 0)):
        raise ValueError(f"the scale factor a must be positive and finite, got {a}")


def integer_value(value) -> int | None:
    """``value`` as an int when it is an integer: ``int``, a numpy integer or a concrete
    0-d integer array (numpy or JAX); None for anything else (a bool, a float, a string,
    a traced value)."""
    if isinstance(value, (bool, np.bool_, jax.core.Tracer)):
        return None
    if isinstance(value, (np.ndarray, jax.Array)):
        return int(value) if value.ndim == 0 and np.issubdtype(value.dtype, np.integer) else None
    return int(value) if isinstance(value, (int, np.integer)) else None


def _check_integer(name: str, value, minimum: int, maximum: int = INT32_MAX) -> int:
    """``value`` as an int, raising a ValueError naming ``name`` unless it is an integer
    (:func:`integer_value`) in ``[minimum, maximum]`` (by default, what the kernels' int32
    can hold)."""
    given, value = value, integer_value(value)
    if value is None:
        raise ValueError(f"{name} must be an integer, got {given!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")
    return value
