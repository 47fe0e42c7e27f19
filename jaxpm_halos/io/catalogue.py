"""HDF5 halo catalogue files, written from one process.

One file per snapshot. The root holds one dataset per catalogue field (``id``, ``count``,
``mass``, ``pos``, ``vel``, ``vel_disp``, ``radius``, ``percolates``, ``peak``, then the
spherical-overdensity masses and radii ``m200c``, ``r200c``, ...; the valid halos only,
sorted by id), each with a ``unit`` attribute where its unit is known (SO datasets also a
``definition``: ``jaxpm_halos.units.so_density``'s, or a name given by the caller), and the
root attributes describe the run:

- ``box_size`` (Mpc/h), ``nc`` (particles per side), ``a`` (scale factor), ``redshift``,
- ``linking_length`` (Mpc/h), ``b`` (in mean separations), ``min_members``,
- ``num_halos``, ``format`` (``"jaxpm_halos.catalogue"``) and ``version``,
- with SO quantities, ``so_definitions`` (e.g. ``["200c", "vir"]``) and ``so_centre``
  (``"com"`` or ``"peak"``),
- any extra attributes passed to :func:`write_catalogue` (under other names: :data:`RESERVED`).

The cosmology and the units are dicts, stored as the attributes of two empty groups,
``/cosmology`` and ``/units``. :func:`load_catalogue` gives everything back as numpy arrays
and Python scalars.

Multi-host choice: **gather the valid catalogue, write one file from process 0.** The
in-situ catalogue is padded per device (``max_halos`` rows each) and sharded over the
devices of all processes. :func:`gather_catalogue` keeps each process's valid rows only
(taken from the shards it holds), all-gathers those compact rows (a catalogue is small:
thousands of rows where the particles are millions), drops blocks held twice (replicated
shards) and sorts by id. Every process must call :func:`gather_catalogue` and
:func:`write_catalogue` (they are collective when ``jax.process_count() > 1``); only
process 0 opens the file. With one process it is a plain copy to host memory. One file per
snapshot, rows sorted by id, keeps the layout independent of the number of hosts and
devices: a 2-host run's file holds the same halos, ids, counts and equal-mass masses bit for
bit as a 1-host one; centres, velocities and radii (means summed in an order the mesh sets)
agree to the working precision's rounding, and SO values about those centres can differ
where that rounding moves a particle across the SO boundary.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core.catalogue import CATALOGUE_FIELDS, DESCRIPTIONS, INSITU_UNITS
from .gather import gather_catalogue

__all__ = ["FIELDS", "INSITU_UNITS", "LoadedCatalogue", "load_catalogue", "write_catalogue"]

FIELDS = CATALOGUE_FIELDS
"""Catalogue fields, in file order (``vel``, ``vel_disp`` and ``peak`` may be absent, and
``percolates`` in files written before it existed). Spherical-overdensity datasets
(``m200c``, ``r200c``, ...) follow, named in the root attribute ``so_definitions``."""

FORMAT, VERSION = "jaxpm_halos.catalogue", 1

REQUIRED = ("id", "count", "mass", "pos", "radius")
"""Datasets every catalogue file holds (``vel`` and ``vel_disp`` are optional)."""

RESERVED = (
    "format",
    "version",
    "box_size",
    "nc",
    "a",
    "redshift",
    "linking_length",
    "b",
    "min_members",
    "num_halos",
    "cosmology",
    "units",
    "so_definitions",
    "so_centre",
)
"""Root attributes written from :func:`write_catalogue`'s own arguments (and the two group
names :func:`load_catalogue` puts among the attributes): not allowed in ``attrs``."""


def write_catalogue(
    path,
    catalogue,
    *,
    box_size: float,
    nc: int,
    a: float,
    cosmology: Mapping[str, Any],
    linking_length: float,
    b: float,
    min_members: int,
    units: Mapping[str, str] | None = None,
    snapshot: int | None = None,
    attrs: Mapping[str, Any] | None = None,
    throw: bool = True,
):
    """Write one snapshot's halo catalogue to an HDF5 file (from process 0 only).

    Args:
      path: file to create (overwritten); its folder is created if needed.
      catalogue: a :class:`~jaxpm_halos.Catalogue` (padded, sharded; see
        :func:`gather_catalogue`, and ``snapshot`` for one stacked over snapshots) or the
        dict of ``Catalogue.to_numpy()``.
      box_size: box side (Mpc/h).
      nc: particles per side.
      a: scale factor of the snapshot.
      cosmology: parameters as ``{name: number or str}``, e.g. ``Omega_c``, ``Omega_b``,
        ``h``, ``sigma8``, ``n_s``.
      linking_length: FoF linking length in the unit of positions (Mpc/h in situ).
      b: the same in units of the mean interparticle separation ``box_size / nc``.
      min_members: smallest group in the catalogue.
      units: ``{field or attribute: unit}``; default: the units an
        :class:`~jaxpm_halos.InSitu` catalogue carries (:data:`INSITU_UNITS`, masses in
        particles without ``omega_m``, SO masses in Msun/h and radii in comoving Mpc/h).
        Required for other catalogues (from :func:`~jaxpm_halos.fof`, or a dict). SO
        datasets not named take the units of ``mass`` and ``pos``; a dataset whose unit is
        neither given nor so derived is written without a ``unit`` attribute.
      snapshot: index into a catalogue stacked over snapshots.
      attrs: extra root attributes (numbers, strings or arrays).
      throw: as :func:`gather_catalogue`'s: by default a catalogue whose status failed
        is not written.

    Returns:
      ``path`` on process 0, None on the other processes. Collective when
      ``jax.process_count() > 1``: every process must call it.

    Raises:
      ValueError: before anything is written, for a catalogue of unknown units without
        ``units``, a setting out of range (``box_size``,
        ``linking_length``, ``b`` positive and finite, ``a`` in ``(0, inf)``, ``nc`` and
        ``min_members`` positive integers, ``linking_length`` equal to
        ``b * box_size / nc`` within 0.1%), a catalogue that lacks a field of
        :data:`REQUIRED` or holds a group smaller than ``min_members``, an ``attrs`` name
        in :data:`RESERVED`, a
        ``units`` key naming no field, SO dataset or attribute (a misspelling), a
        field that is neither in :data:`FIELDS` nor an SO mass and radius pair (it would
        not be read back), ids that are not unique and sorted (a dict catalogue), or a
        value HDF5 cannot store. A write that fails leaves no file
        behind.
    """
    import jax

    contents = catalogue_contents(
        catalogue,
        box_size=box_size,
        nc=nc,
        a=a,
        cosmology=cosmology,
        linking_length=linking_length,
        b=b,
        min_members=min_members,
        units=units,
        snapshot=snapshot,
        attrs=attrs,
        throw=throw,
    )
    if jax.process_index() != 0:
        return None
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"write_catalogue: {path!r} is a directory; give a file path")
    _make_folder(os.path.dirname(path), path)
    atomic_write(path, lambda tmp: write_contents(tmp, *contents))
    return path


def atomic_write(path: str, write) -> None:
    """``write(tmp)`` to a temporary name beside ``path``, then rename it to ``path``: a
    write that fails leaves what was at ``path`` (and no temporary)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def catalogue_contents(
    catalogue,
    *,
    box_size,
    nc,
    a,
    cosmology,
    linking_length,
    b,
    min_members,
    units=None,
    snapshot=None,
    attrs=None,
    throw=True,
):
    """``(fields, units, root attributes, cosmology)`` of a catalogue file, checked as
    :func:`write_catalogue` documents (collective: gathers the catalogue)."""
    root = _run_attrs(box_size, nc, a, linking_length, b, min_members)
    extra = {}
    for name, value in (attrs or {}).items():
        if not isinstance(name, str):
            raise ValueError(f"attrs: names must be strings, got {name!r}")
        if name in RESERVED:
            raise ValueError(
                f"attrs: {name!r} is reserved for write_catalogue's own "
                f"attributes {RESERVED}; give it another name"
            )
        extra[name] = _attr(value, f"attrs[{name!r}]")
    if not isinstance(cosmology, Mapping):
        raise ValueError(f"cosmology must be a dict of parameters, got {cosmology!r}")
    cosmology = {str(k): _attr(v, f"cosmology[{k!r}]") for k, v in cosmology.items()}
    units = _units(catalogue, units)  # before the gather, which is collective
    fields = gather_catalogue(catalogue, snapshot, throw=throw)
    _check_written_rows(fields, root["min_members"])
    ids = np.asarray(fields["id"])
    if ids.ndim != 1 or np.any(ids[1:] <= ids[:-1]):
        raise ValueError(
            "write_catalogue: the catalogue's ids must be unique and sorted, one "
            "halo per row (as Catalogue.to_numpy() gives them): sort the rows by "
            "id and drop repeats"
        )
    so = _so_definitions(catalogue, fields)
    _check_unit_names(units, so, extra)
    units = _so_units(units, so)
    unknown = sorted(set(fields) - set(FIELDS) - {p + n for n in so for p in "mr"})
    if unknown:
        raise ValueError(
            f"write_catalogue writes a catalogue's fields {FIELDS} and its SO "
            f"masses and radii (m<name>, r<name> pairs); {unknown} are neither, "
            "and load_catalogue would not read them back: write them apart"
        )
    root["num_halos"] = int(fields["id"].shape[0])
    if so:
        root["so_definitions"] = _attr(np.asarray(so))
        root["so_centre"] = getattr(catalogue, "centre", "peak" if "peak" in fields else "com")
    return fields, units, {**root, **extra}, cosmology


def _make_folder(folder: str, path: str) -> None:
    """Create ``folder`` (and its parents) for ``path``, or raise NotADirectoryError
    naming the part of it that is a file."""
    above = folder
    while above and not os.path.exists(above):
        above = os.path.dirname(above)
    if above and not os.path.isdir(above):
        raise NotADirectoryError(
            f"write_catalogue: cannot write {path!r}: {above!r} is a file, not a "
            "directory; give a path inside a directory"
        )
    if folder:
        os.makedirs(folder, exist_ok=True)


def _so_definitions(catalogue, fields) -> list[str]:
    """The SO definitions of a catalogue (``"200c"`` for ``m200c`` and ``r200c``)."""
    names = (
        list(catalogue.so)
        if getattr(catalogue, "so", None)
        else [f for f in fields if f not in FIELDS]
    )
    return [n[1:] for n in names if n.startswith("m") and "r" + n[1:] in fields]


def _so_units(units: dict, so) -> dict:
    """``units`` with those of the SO datasets it lacks: an SO mass sums the particle masses
    and an SO radius is a distance, so they take the units of ``mass`` and ``pos``."""
    units = dict(units)
    for name in so:
        for prefix, field in (("m", "mass"), ("r", "pos")):
            if field in units:
                units.setdefault(prefix + name, units[field])
    return units


def _is_standard_so(name: str) -> bool:
    """Whether ``name`` (``"200c"``) is a definition :func:`jaxpm_halos.units.so_density`
    knows, the one parser of definition names (any valid omega_m will do)."""
    from ..units import so_density

    try:
        so_density(name, omega_m=0.3)
        return True
    except ValueError:
        return False


def _check_unit_names(units: dict, so, extra) -> None:
    """Raise for a ``units`` key that names nothing a catalogue file can hold: a misspelt
    field (``"Mass"``) would otherwise leave the real one without a unit, silently. SO
    datasets of standard definitions are names too: one units dict may serve several runs."""
    is_so = lambda key: key[:1] in ("m", "r") and (key[1:] in so or _is_standard_so(key[1:]))
    unknown = sorted(
        key
        for key in units
        if key not in FIELDS and key not in RESERVED and key not in extra and not is_so(key)
    )
    if unknown:
        raise ValueError(
            f"write_catalogue: units names {unknown}, which are neither catalogue "
            f"fields {FIELDS}, SO masses and radii (m<name>, r<name>), nor root "
            "attributes; check the spelling"
        )


def _so_definition(name: str, kind: str, centre: str) -> str:
    """The ``definition`` attribute of SO dataset ``m<name>`` or ``r<name>``."""
    if _is_standard_so(name):
        threshold = f"threshold jaxpm_halos.units.so_density({name!r}) at the snapshot's a"
    else:
        threshold = (
            f"threshold named {name!r} by the caller, a density not recorded here "
            "(store it with attrs=)"
        )
    about = "density peak" if centre == "peak" else "centre of mass"
    return (
        f"spherical-overdensity {kind}, {threshold}, first downcrossing over all "
        f"particles about the {about}"
    )


def _units(catalogue, units) -> dict:
    """The given ``units``, else those the catalogue carries (in situ), else an error: a
    default would label e.g. ``fof``'s unit masses as Msun/h."""
    if units is None:
        units = getattr(catalogue, "units", None)
        if units is None:
            raise ValueError(
                "write_catalogue: this catalogue's units are not known (fof's fields are in "
                "the units of its inputs; only an InSitu catalogue carries them): pass "
                "units={field: unit}, e.g. dict(jaxpm_halos.io.INSITU_UNITS) for positions "
                "in Mpc/h, masses in Msun/h and velocities in km/s, with 'mass': "
                "'particles' for unit masses (SO masses and radii take the units of "
                "'mass' and 'pos' unless named)"
            )
    return {str(k): str(v) for k, v in dict(units).items()}


def write_contents(path, fields, units, root, cosmology, extend=None):
    """Write a catalogue file's contents (:func:`catalogue_contents`) to ``path``, then
    ``extend(file)`` (an open ``h5py.File``) to add more."""
    import h5py

    so = [n for n in fields if n not in FIELDS]
    centre = root.get("so_centre", "com")
    with h5py.File(path, "w") as f:
        for name in [n for n in FIELDS if n in fields] + so:
            ds = f.create_dataset(name, data=fields[name])
            if name in units:
                ds.attrs["unit"] = units[name]
            if name in DESCRIPTIONS:
                ds.attrs["description"] = DESCRIPTIONS[name]
            if name in so:
                kind = "mass" if name[0] == "m" else "radius"
                ds.attrs["definition"] = _so_definition(name[1:], kind, centre)
        f.attrs.update(root)
        f.create_group("cosmology").attrs.update(cosmology)
        f.create_group("units").attrs.update(units)
        if extend is not None:
            extend(f)


def _check_written_rows(fields: Mapping[str, Any], min_members: int) -> None:
    """Refuse rows that :func:`load_catalogue` would not read back (a field of
    :data:`REQUIRED` missing) or that the ``min_members`` written with them contradicts."""
    missing = [name for name in REQUIRED if name not in fields]
    if missing:
        raise ValueError(
            f"write_catalogue: the catalogue lacks {missing}, which "
            f"load_catalogue requires (fields {REQUIRED}); write a whole "
            "catalogue (Catalogue.to_numpy() gives every field)"
        )
    count = np.asarray(fields["count"])
    if count.size and int(count.min()) < min_members:
        raise ValueError(
            f"write_catalogue: min_members={min_members}, but the catalogue "
            f"holds a group of {int(count.min())} members; give the "
            "min_members the catalogue was built with"
        )


def _run_attrs(box_size, nc, a, linking_length, b, min_members) -> dict:
    """The validated root attributes that describe the run."""
    from ..core.particles import _check_integer

    values = {}
    for name, value in (
        ("box_size", box_size),
        ("a", a),
        ("linking_length", linking_length),
        ("b", b),
    ):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {value!r}") from None
        if not (value > 0 and np.isfinite(value)):
            raise ValueError(f"{name} must be positive and finite, got {value}")
        values[name] = value
    nc = _check_integer("nc", nc, 1)
    link = values["b"] * values["box_size"] / nc
    if abs(values["linking_length"] - link) > 1e-3 * link:
        raise ValueError(
            f"linking_length={values['linking_length']:g} is not "
            f"b * box_size / nc = {values['b']:g} * {values['box_size']:g} / {nc} "
            f"= {link:g}: give the b and linking_length the catalogue was built "
            "with"
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "box_size": values["box_size"],
        "nc": nc,
        "a": values["a"],
        "redshift": 1.0 / values["a"] - 1.0,
        "linking_length": values["linking_length"],
        "b": values["b"],
        "min_members": _check_integer("min_members", min_members, 1),
    }


def _attr(value, name: str = "attribute"):
    """``value`` as HDF5 stores it: a number or string, or a numeric / string array."""
    if isinstance(value, (str, bytes, bool, int, float)):
        return value
    given, value = value, np.asarray(value)
    if value.dtype.kind == "U":  # h5py stores str arrays as variable-length strings
        if not all(isinstance(item, str) for item in np.asarray(given, object).reshape(-1)):
            # numpy made the numbers strings: they would read back as text
            raise ValueError(
                f"{name}: an array attribute holds numbers or strings, not both; got {given!r}"
            )
        import h5py

        value = value.astype(h5py.string_dtype())
    elif value.dtype.kind not in "biufcS":
        raise ValueError(
            f"{name}: HDF5 attributes hold numbers, strings or arrays of them; "
            f"got {value.dtype} ({value!r})"
        )
    return value.item() if value.ndim == 0 else value


@dataclasses.dataclass
class LoadedCatalogue:
    """A catalogue file read back by :func:`load_catalogue`.

    Attributes:
      fields: ``{field: numpy array}`` (valid halos, sorted by id).
      attrs: the root attributes, plus ``"cosmology"`` and ``"units"`` as dicts.

    ``cat["mass"]`` is ``cat.fields["mass"]``; ``len(cat)`` is the number of halos.
    """

    fields: dict
    attrs: dict

    def __getitem__(self, name):
        return self.fields[name]

    def __contains__(self, name):
        return name in self.fields

    def keys(self):
        return self.fields.keys()

    def __len__(self):
        return int(self.fields["id"].shape[0])


def load_catalogue(path) -> LoadedCatalogue:
    """Read a file written by :func:`write_catalogue`.

    Raises ValueError, naming the problem, for an HDF5 file that is not a catalogue, lacks
    a dataset of :data:`REQUIRED`, a group or a dataset of a definition in its
    ``so_definitions``, has datasets whose rows disagree, or whose ``num_halos`` is not
    their row count; h5py's OSError for a path that is missing or not HDF5 at all.
    """
    import h5py

    def plain(attrs):
        return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in attrs.items()}

    with h5py.File(path, "r") as f:
        if f.attrs.get("format") != FORMAT:
            raise ValueError(f"{path} is not a jaxpm_halos catalogue file")
        missing = [name for name in REQUIRED + ("cosmology", "units") if name not in f]
        if missing:
            raise ValueError(f"{path}: the catalogue file lacks {missing}")
        so = [str(n) for n in np.atleast_1d(f.attrs.get("so_definitions", []))]
        so_fields = [p + n for n in so for p in ("m", "r")]
        missing = [name for name in so_fields if name not in f]
        if missing:
            raise ValueError(f"{path}: so_definitions lists {so}, but the file lacks {missing}")
        fields = {name: f[name][()] for name in list(FIELDS) + so_fields if name in f}
        attrs = plain(f.attrs)
        attrs["cosmology"] = plain(f["cosmology"].attrs)
        attrs["units"] = plain(f["units"].attrs)
    _check_rows(path, fields, attrs.get("num_halos"))
    return LoadedCatalogue(fields, attrs)


def _check_rows(path, fields, num_halos):
    """Every field has one row per halo (``(n, 3)`` for vectors), and ``n == num_halos``."""
    if fields["id"].ndim != 1:
        raise ValueError(f"{path}: dataset 'id' has shape {fields['id'].shape}, not (halos,)")
    n = fields["id"].shape[0]
    for name, value in fields.items():
        shape = (n, 3) if name in ("pos", "vel", "peak") else (n,)
        if value.shape != shape:
            raise ValueError(
                f"{path}: dataset {name!r} has shape {value.shape}; with {n} ids "
                f"it should be {shape}"
            )
    if num_halos != n:
        raise ValueError(
            f"{path}: attribute num_halos is {num_halos!r}, but the datasets hold {n} halos"
        )
