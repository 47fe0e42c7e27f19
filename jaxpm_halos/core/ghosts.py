"""Ghost layers and periodic images shared by every analysis.

A device receives ghost copies of the particles within a search radius of its pencil
(:mod:`.domain`); :func:`ghost_width` pads that radius for float rounding at the faces, and
:func:`widest_linking_length` inverts it for the narrowest pencil of a mesh. The box is
never cut along z, so its periodicity there is handled by images of the rows near
z = 0 and z = L (:func:`z_image_rows`, :func:`z_images`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .domain import Extended
from .layout import Pencils
from .rows import selection


def z_image_rows(ext: Extended, width: float, box_size: float, rows: int):
    """The periodic images along z of the rows within ``width`` of z = 0 (placed at
    z + L) and of z = L (at z - L), ``rows`` of each.

    Returns the extended row (2 rows,) each image copies, its side (2 rows,) (+1: at
    z + L, -1: at z - L), its validity, and the rows the images needed.
    """
    z = ext.pos[:, 2]
    low, n_low = selection(ext.valid & (z < width), rows)
    high, n_high = selection(ext.valid & (z >= box_size - width), rows)
    side = jnp.concatenate([jnp.ones(rows, jnp.int8), jnp.full(rows, -1, jnp.int8)])
    valid = jnp.concatenate([jnp.arange(rows) < n_low, jnp.arange(rows) < n_high])
    return jnp.concatenate([low, high]), side, valid, jnp.maximum(n_low, n_high)


def z_images(ext: Extended, width: float, box_size: float, rows: int):
    """Append periodic images along z of the rows within ``width`` of z = 0 and z = L.

    Returns the local-frame positions of all rows (extended rows, then images), their
    validity, the extended row each image copies, and the rows the images needed.
    """
    pos = ext.local_pos(box_size)
    source, side, image_valid, need = z_image_rows(ext, width, box_size, rows)
    shift = box_size * side.astype(pos.dtype)
    image_pos = jnp.take(pos, source, axis=0, mode="fill", fill_value=0).at[:, 2].add(shift)
    return (
        jnp.concatenate([pos, image_pos]),
        jnp.concatenate([ext.valid, image_valid]),
        source,
        need,
    )


_GHOST_MARGIN = (1e-5, 8 * float(np.finfo(np.float32).eps))  # relative to l, to the box


def ghost_width(linking_length: float, box_size: float) -> float:
    """Ghost layer for a search radius (FoF's linking length, an SO radius): the radius plus
    a margin for float rounding at the faces."""
    return float(linking_length) * (1 + _GHOST_MARGIN[0]) + _GHOST_MARGIN[1] * box_size


def widest_linking_length(pencils: Pencils) -> float:
    """The largest linking length whose ghost layer fits the narrowest pencil of
    ``pencils``' mesh (:func:`ghost_width` inverted)."""
    box = pencils.box_size
    return (min(pencils.widths) - _GHOST_MARGIN[1] * box) / (1 + _GHOST_MARGIN[0])
