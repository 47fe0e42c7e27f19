"""kNN search frame of one device: ghost width, the frame's static geometry, and the
device's rows sorted by Morton key (the index every search reads).

Shapes in comments: ``E`` extended rows (owned and ghosts, padded), ``R`` rows of the
index (the valid extended rows and z images, sorted, then padding).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.cells import MORTON_BITS, morton_key, sort_rows
from ..core.config import KNNConfig
from ..core.ghosts import z_image_rows
from ..core.layout import Pencils
from ..core.rows import selection

int32 = jnp.int32
SENTINEL = np.iinfo(np.int32).max
LEVELS = MORTON_BITS


def uniform_knn_radius(k: int, total: int, box_size: float) -> float:
    """The k-th neighbour distance in a uniform density of ``total`` particles."""
    density = total / box_size**3
    return (3 * k / (4 * math.pi * density)) ** (1 / 3)


def requested_width(k: int, total: int, box_size: float, config: KNNConfig) -> float:
    """The ghost width asked for, before the cap at the pencil side."""
    if config.ghost_width is not None:
        return max(float(config.ghost_width), 0.0)
    return config.ghost_factor * uniform_knn_radius(k, total, box_size)


def ghost_width(k: int, total: int, pencils: Pencils, config: KNNConfig = KNNConfig()) -> float:
    """Ghost layer used by kNN: ``config.ghost_width`` or ``ghost_factor`` times the uniform
    k-th neighbour distance, capped at the narrower pencil side (a wider sphere is completed
    by the cross-device pass)."""
    wx, wy = pencils.widths
    return float(min(requested_width(k, total, pencils.box_size, config), wx, wy))


@dataclasses.dataclass(frozen=True)
class SearchFrame:
    """Static geometry of a device's frame: the pencil plus ghost layers of ``width`` in x
    and y, the box plus images of ``width`` in z, inside a cube of side ``side``;
    ``margin`` absorbs float rounding in every coverage test."""

    box: float
    width: float
    side: float
    margin: float

    @classmethod
    def of(cls, pencils: Pencils, width: float, dtype) -> SearchFrame:
        wx, wy = pencils.widths
        box = pencils.box_size
        side = max(wx, wy, box) + 2 * width
        side *= 1 + 1e-5
        eps = float(np.finfo(dtype).eps)
        return cls(box, float(width), float(side), 32 * eps * (box + side))

    def arrays(self, pencils: Pencils, dtype):
        """Traced ``(origin, cover_lo, cover_hi)``: the frame's origin (3,) and the box the
        ghost layer fully covers, shrunk by the margin."""
        lo, hi = pencils.bounds()
        w = jnp.asarray(self.width, dtype)
        origin = jnp.stack([lo[0].astype(dtype) - w, lo[1].astype(dtype) - w, -w])
        top = jnp.stack(
            [hi[0].astype(dtype) + w, hi[1].astype(dtype) + w, jnp.asarray(self.box, dtype) + w]
        )
        m = jnp.asarray(self.margin, dtype)
        return origin, origin + m, top - m

    @property
    def full(self) -> float:
        """A radius that makes any batch search the whole frame."""
        return 4.0 * self.side


def finest_cells(frame: SearchFrame, local, origin):
    """Finest-level octree cell (n, 3) of frame positions ``local`` (n, 3)."""
    fine = frame.side / (1 << LEVELS)
    cell = jnp.floor((local - origin) / jnp.asarray(fine, local.dtype)).astype(int32)
    return jnp.clip(cell, 0, (1 << LEVELS) - 1)


def morton_of(frame: SearchFrame, local, origin, valid):
    """Morton key (n,) of frame positions, ``SENTINEL`` where not valid."""
    cell = finest_cells(frame, local, origin)
    return jnp.where(valid, morton_key(cell[:, 0], cell[:, 1], cell[:, 2]), SENTINEL)


def image_code(sx, sy, sz):
    """One int8 (...,) for the periodic image ``(sx, sy, sz)`` (each -1, 0 or 1) that
    places a row in the device's frame: two bits per axis."""
    return ((sx + 1) | ((sy + 1) << 2) | ((sz + 1) << 4)).astype(jnp.int8)


def in_frame(cx, cy, cz, code, box: float):
    """Frame positions (..., 3) of canonical coordinates ``cx, cy, cz`` (...,) in the
    periodic image ``code`` (...,) (:func:`image_code`): the canonical position plus ``box``
    times the image, rounded as the decomposition rounds it (``Extended.local_pos``)."""
    code = code.astype(int32)
    shifts = tuple(((code >> (2 * d)) & 3) - 1 for d in range(3))
    return jnp.stack([c + box * s.astype(c.dtype) for c, s in zip((cx, cy, cz), shifts)], axis=-1)


def row_images(ext, source, side):
    """Image codes (E + 2 image_rows,) int8 of the extended rows (E,) followed by their z
    images (``source``, ``side`` from :func:`~jaxpm_halos.core.ghosts.z_image_rows`). Coded apart
    and joined as int8: no int32 image array of that length is formed."""
    images = ext.image[jnp.minimum(source, ext.pos.shape[0] - 1)]  # (2 image_rows, 2)
    return jnp.concatenate(
        [
            image_code(ext.image[:, 0], ext.image[:, 1], 0),
            image_code(images[:, 0], images[:, 1], side),
        ]
    )


class Index(NamedTuple):
    """One device's rows (owned, ghosts, z images) sorted by Morton key, so that every
    octree node at every level is one contiguous range of rows.

    Attributes:
      key: (R,) sorted keys, ``SENTINEL`` after the valid rows.
      cx, cy, cz: (R,) canonical positions (stopped gradients), one array per coordinate
        (contiguous loads in the distance kernels); every distance is computed from them.
      image: (R,) int8 the periodic image that places each row in the device's frame
        (:func:`image_code`); :meth:`local` gives the positions there.
      ext_row: (R,) extended row (:class:`~jaxpm_halos.core.domain.Extended`) each sorted row
      copies. ext_id: (E,) the extended rows' global ids (the decomposition's own array).
      owned: (R,) bool: an owned row itself (not a ghost, not an image).
    """

    key: jax.Array
    cx: jax.Array
    cy: jax.Array
    cz: jax.Array
    image: jax.Array
    ext_row: jax.Array
    ext_id: jax.Array
    owned: jax.Array

    @property
    def rows(self) -> int:
        return self.key.shape[0]

    def id(self, rows):
        """Global ids (...,) of valid sorted rows (...,)."""
        return self.ext_id[self.ext_row[rows]]

    def canon(self, rows):
        """Canonical positions (..., 3) of sorted rows (...,)."""
        return jnp.stack([self.cx[rows], self.cy[rows], self.cz[rows]], axis=-1)

    def local(self, rows, box: float):
        """Positions (..., 3) of sorted rows (...,) in the device's frame."""
        return in_frame(self.cx[rows], self.cy[rows], self.cz[rows], self.image[rows], box)


def frame_share(pencils: Pencils, width: float) -> float:
    """The volume of a device's frame (pencil, ghost layers of ``width`` and z images) over
    its pencil's."""
    wx, wy = pencils.widths
    box = pencils.box_size
    return (wx + 2 * width) * (wy + 2 * width) * (box + 2 * width) / (wx * wy * box)


def build_index(frame: SearchFrame, ext, origin, image_rows: int, index_rows: int):
    """Sort a device's valid extended rows plus z images, ``index_rows`` at most. Returns
    ``(index, need_images, need_index)``: the rows the z images and the index needed.

    The exchange buffers are padded to their own worst cases, so the valid rows are
    selected first, and the index, its sort included, holds ``index_rows`` rows, not every
    exchanged one. Rows are held as canonical coordinates and an image code: no (R, 3)
    array of frame positions is ever stored (they are recomputed where needed)."""
    source, side, image_valid, need_images = z_image_rows(ext, frame.width, frame.box, image_rows)
    n_ext = ext.pos.shape[0]
    valid = jnp.concatenate([ext.valid, image_valid])  # (E + 2 image_rows,)
    picked, count = selection(valid, index_rows)  # (R,) padded with E + 2 image_rows
    ext_row = jnp.concatenate([jnp.arange(n_ext, dtype=int32), source])
    ext_row = jnp.take(ext_row, picked, mode="fill", fill_value=0)  # (R,)
    code = jnp.take(row_images(ext, source, side), picked, mode="fill", fill_value=0)
    canon_ext = lax.stop_gradient(ext.pos)  # (E, 3)
    local = in_frame(*(canon_ext[:, d][ext_row] for d in range(3)), code, frame.box)
    kept = jnp.arange(index_rows) < count
    key, order = sort_rows(morton_of(frame, local, origin, kept))
    sorted_ext_row = ext_row[order]
    sorted_code = code[order]
    # An owned row itself: not a ghost (those come after the owned rows), not an image.
    owned = (
        (sorted_ext_row < ext.owned)
        & (sorted_code == image_code(jnp.int32(0), 0, 0))
        & (key != SENTINEL)
    )
    # One coordinate at a time: no (R, 3) copy of the canonical positions.
    cx, cy, cz = (canon_ext[:, d][sorted_ext_row] for d in range(3))
    index = Index(key, cx, cy, cz, sorted_code, sorted_ext_row, ext.id, owned)
    return index, need_images, count
