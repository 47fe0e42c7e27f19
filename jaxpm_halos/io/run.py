"""A run directory: every snapshot's catalogue, members and merger links, the merger tree,
and the metadata a stranger needs, written by one call and read back by another.

Layout of ``directory/``:

- ``run.h5``: the run's metadata as root attributes (box, particles, PM grid, steps, seed,
  FoF and SO settings, mesh, versions, creation time), ``/cosmology`` (attributes), the
  datasets ``a`` and ``redshift`` of the snapshots, and ``/tree``: ``main_branch`` (one row
  per halo of the last snapshot, its main progenitor's id at every snapshot, -1 before the
  branch began) and ``mass`` along it.
- ``snapshot_000.h5``, ...: a catalogue file (:func:`~jaxpm_halos.load_catalogue` reads it)
  plus ``/members`` (``offset``, ``count``, ``ids``: Gadget-4's layout, rows aligned with
  the catalogue's) and ``/links`` (``descendant``, ``shared`` into the next snapshot;
  ``main_progenitor``, ``n_progenitors`` from the previous one), aligned with its rows.

Every dataset carries a ``unit`` where it has one and a ``description``. The whole
directory is written under a temporary name and then renamed, so a failed write leaves
what was there.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
from collections.abc import Mapping
from importlib import metadata

import numpy as np

from ..core.config import MergerConfig
from ..merger.tree import along_branches, main_branches, snapshot_links
from ..units import cosmology_dict
from .catalogue import LoadedCatalogue, _attr, catalogue_contents, load_catalogue, write_contents
from .members import halo_members

FORMAT, VERSION = "jaxpm_halos.run", 1

MEMBER_DESCRIPTIONS = {
    "offset": "first row in ids of each halo's members (rows aligned with the catalogue)",
    "count": "number of members of each halo",
    "ids": "member particle ids (the lattice index (ix * nc + iy) * nc + iz, as halo ids), "
    "sorted within each halo",
}
LINK_DESCRIPTIONS = {
    "descendant": "id of the halo of the next snapshot holding most of this halo's "
    "particles (ties to the smallest id); -1: none, or the last snapshot",
    "shared": "particles this halo gives its descendant",
    "main_progenitor": "id of the previous snapshot's halo, among those whose descendant "
    "this is, that gives it most particles (ties to the smallest id); -1: none",
    "n_progenitors": "haloes of the previous snapshot whose descendant this is",
}


def write_run(
    directory,
    out,
    insitu,
    *,
    times,
    cosmology,
    steps: int | None = None,
    seed: int | None = None,
    attrs: Mapping | None = None,
    links: MergerConfig = MergerConfig(),
    lightcone: Mapping | None = None,
    throw: bool = True,
):
    """Write an in-situ run's catalogues, members, merger links and tree to ``directory``.

    Args:
      directory: the run directory (created; replaced if it exists).
      out: the in-situ outputs stacked over snapshots, as ``diffeqsolve`` returns them with
        ``saveat=insitu.saveat(ts=times)`` (``sol.ys``), holding ``"fof"``.
      insitu: the :class:`~jaxpm_halos.InSitu` that made them.
      times: the snapshots' scale factors, in order (earliest first).
      cosmology: a jax_cosmo ``Cosmology`` or a dict of parameters (``Omega_c``,
        ``Omega_b``, ``h``, ``sigma8``, ``n_s``, ``w0``, ``wa``); ``Omega_m`` is added.
      steps, seed: the run's PM steps and seed, recorded when given.
      attrs: more root attributes of ``run.h5`` (numbers, strings or arrays).
      links: the pair buffer of :func:`~jaxpm_halos.merger_links`.
      lightcone: also write the halo light cone of these snapshots,
        ``{"observer": (x, y, z), "z_max": z}`` (see :func:`~jaxpm_halos.lightcone`);
        it needs the ``vel`` field.
      throw: refuse a snapshot whose status failed (``False``: write it anyway).

    Returns ``directory`` on process 0, None on the others. Collective when
    ``jax.process_count() > 1``: every process must call it.
    """
    import jax

    fof = _fof_outputs(out)
    labels, catalogue = fof["labels"], fof["catalogue"]
    times = [float(a) for a in np.atleast_1d(times)]
    if len(times) != np.shape(labels)[0] or np.any(np.diff(times) <= 0):
        raise ValueError(
            f"times must be the {np.shape(labels)[0]} snapshots' scale factors, increasing; "
            f"got {times}"
        )
    cosmology = cosmology_dict(cosmology, insitu.omega_m)
    cosmology = {k: _attr(v, f"cosmology[{k!r}]") for k, v in cosmology.items()}
    nc = np.shape(labels)[-1]
    snapshots = []
    for i, a in enumerate(times):
        contents = catalogue_contents(
            catalogue,
            box_size=insitu.box_size,
            nc=nc,
            a=a,
            cosmology=cosmology,
            linking_length=insitu.b * insitu.box_size / nc,
            b=insitu.b,
            min_members=insitu.min_members,
            snapshot=i,
            throw=throw,
        )
        members = halo_members(labels[i], contents[0]["id"])
        _check_members(members, contents[0], i)
        snapshots.append((contents, members))
    pair_links = _links(labels, catalogue, links, throw) if len(times) > 1 else []
    root = _run_attrs(insitu, nc, labels, times, steps, seed, attrs)
    cone = None
    if lightcone is not None:
        cone = _lightcone([c[0] for c, _ in snapshots], times, cosmology, insitu, lightcone)
        root.update(lightcone_observer=np.asarray(lightcone["observer"], float))
        root.update(lightcone_z_max=float(lightcone["z_max"]))
    if jax.process_index() != 0:
        return None
    directory = os.fspath(directory)
    _replace_directory(
        directory, lambda tmp: _write_all(tmp, root, cosmology, snapshots, pair_links, cone)
    )
    return directory


def _lightcone(catalogues, times, cosmology, insitu, settings) -> dict:
    from ..lightcone import lightcone

    unknown = set(settings) - {"observer", "z_max"}
    if unknown:
        raise ValueError(f"lightcone takes observer and z_max; got {sorted(unknown)}")
    return lightcone(
        catalogues,
        times,
        observer=settings["observer"],
        z_max=settings["z_max"],
        cosmology=cosmology,
        box_size=insitu.box_size,
    )


def _fof_outputs(out) -> Mapping:
    if not isinstance(out, Mapping) or "fof" not in out:
        raise ValueError(
            "write_run takes the in-situ outputs of a run with the 'fof' analysis, stacked "
            "over snapshots: sol.ys of diffeqsolve(..., saveat=insitu.saveat(ts=times))"
        )
    fof = out["fof"]
    if np.ndim(fof["catalogue"].id) != 2:
        raise ValueError(
            "write_run takes outputs stacked over snapshots (sol.ys); for one snapshot, "
            "use write_catalogue"
        )
    return fof


def _check_members(members, fields, snapshot: int) -> None:
    """Every halo's members are exactly its ``count`` (labels and catalogue agree)."""
    if not np.array_equal(members["count"], np.asarray(fields["count"])):
        raise ValueError(
            f"snapshot {snapshot}: the labels do not match the catalogue's counts; pass "
            "the labels and catalogue of the same in-situ output"
        )


def _links(labels, catalogue, config, throw) -> list[tuple[dict, dict]]:
    stacked = snapshot_links(labels, catalogue, config=config)
    count = np.shape(stacked.id)[0]
    import jax

    return [jax.tree.map(lambda x, i=i: x[i], stacked).to_numpy(throw=throw) for i in range(count)]


def _versions() -> dict:
    out = {}
    for package in ("jaxpm_halos", "jax", "jaxlib", "jaxpm", "jaxdecomp"):
        try:
            out[f"version_{package}"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[f"version_{package}"] = "not installed"
    return out


def _run_attrs(insitu, nc, labels, times, steps, seed, attrs) -> dict:
    from .. import units

    mesh = getattr(getattr(labels, "sharding", None), "mesh", None)
    root = {
        "format": FORMAT,
        "version": VERSION,
        "box_size": float(insitu.box_size),
        "nc": int(nc),
        "pm_nc": int(insitu.pm_nc or nc),
        "num_snapshots": len(times),
        "analyses": _attr(np.asarray(insitu.analyses)),
        "b": float(insitu.b),
        "linking_length": float(insitu.b * insitu.box_size / nc),
        "min_members": int(insitu.min_members),
        "k": int(insitu.k),
        "so_centre": insitu.centre,
        "mesh_shape": np.asarray(list(dict(mesh.shape).values()) if mesh else [1]),
        "created": datetime.datetime.now(datetime.UTC).isoformat(),
        **_versions(),
    }
    if insitu.so:
        root["so_definitions"] = _attr(np.asarray(insitu.so))
    if insitu.omega_m is not None:
        root["particle_mass"] = float(units.particle_mass(insitu.omega_m, insitu.box_size, nc))
    for name, value in (("steps", steps), ("seed", seed)):
        if value is not None:
            root[name] = int(value)
    for name, value in (attrs or {}).items():
        if name in root:
            raise ValueError(f"attrs: {name!r} is one of write_run's own attributes")
        root[str(name)] = _attr(value, f"attrs[{name!r}]")
    return root


def _replace_directory(directory: str, write) -> None:
    """``write(tmp)`` into a fresh temporary directory, then put it at ``directory``."""
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp, old = f"{directory}.tmp{os.getpid()}", f"{directory}.old{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp)
    try:
        write(tmp)
        if os.path.exists(directory):
            os.rename(directory, old)
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_all(tmp, root, cosmology, snapshots, pair_links, cone) -> None:
    import h5py

    for i, (contents, members) in enumerate(snapshots):
        later = pair_links[i][0] if i < len(pair_links) else None
        earlier = pair_links[i - 1][1] if i > 0 else None
        extend = lambda f, m=members, e=earlier, la=later, c=contents: _extend(f, c[0], m, e, la)
        write_contents(os.path.join(tmp, _snapshot_name(i)), *contents, extend=extend)
    with h5py.File(os.path.join(tmp, "run.h5"), "w") as f:
        f.attrs.update(root)
        f.create_group("cosmology").attrs.update(cosmology)
        a = np.asarray([c[2]["a"] for c, _ in snapshots])
        _dataset(f, "a", a, "", "scale factor of each snapshot")
        _dataset(f, "redshift", 1 / a - 1, "", "redshift of each snapshot")
        tree = f.create_group("tree")
        if pair_links:
            branches = main_branches([backward for _, backward in pair_links])
            catalogues = [c[0] for c, _ in snapshots]
            mass_unit = snapshots[0][0][1].get("mass", "")
            _dataset(tree, "main_branch", branches, "", _BRANCH)
            mass = along_branches(branches, catalogues, "mass")
            _dataset(tree, "mass", mass, mass_unit, "FoF mass along the main branch; NaN: none")
        if cone is not None:
            group = f.create_group("lightcone")
            units = snapshots[0][0][1]
            for name, value in cone.items():
                unit, description = CONE_FIELDS.get(name, (units.get(name, ""), ""))
                description = description or f"the halo's {name} at its snapshot"
                _dataset(group, name, value, unit, description)


CONE_FIELDS = {
    "snapshot": ("", "index of the snapshot the halo is taken from"),
    "chi": ("Mpc/h", "comoving distance from the observer where the halo meets the light cone"),
    "cone_pos": ("Mpc/h", "position on the light cone, relative to the observer"),
    "ra": ("degree", "right ascension, about the box's z axis from its x axis"),
    "dec": ("degree", "declination from the box's x-y plane"),
    "z_cos": ("", "cosmological redshift at the crossing"),
    "z_obs": ("", "observed redshift: (1 + z_cos)(1 + v_r / c) - 1"),
}

_BRANCH = (
    "one row per halo of the last snapshot; column s: the id of its main progenitor at "
    "snapshot s (the halo itself in the last column), -1 before the branch began"
)


def _extend(f, fields, members, earlier, later) -> None:
    group = f.create_group("members")
    for name, value in members.items():
        _dataset(
            group, name, value, "particles" if name == "count" else "", MEMBER_DESCRIPTIONS[name]
        )
    group = f.create_group("links")
    n = len(fields["id"])
    columns = {
        "descendant": later["descendant"] if later else np.full(n, -1),
        "shared": later["shared"] if later else np.zeros(n, np.int64),
        "main_progenitor": earlier["main_progenitor"] if earlier else np.full(n, -1),
        "n_progenitors": earlier["n_progenitors"] if earlier else np.zeros(n, np.int64),
    }
    for links, side in ((later, "id"), (earlier, "id")):
        if links is not None and not np.array_equal(links[side], fields["id"]):
            raise AssertionError("merger links and catalogue rows are not aligned")
    for name, value in columns.items():
        unit = "particles" if name in ("shared",) else ""
        _dataset(group, name, np.asarray(value, np.int64), unit, LINK_DESCRIPTIONS[name])


def _dataset(group, name, value, unit: str, description: str) -> None:
    ds = group.create_dataset(name, data=value)
    if unit:
        ds.attrs["unit"] = unit
    ds.attrs["description"] = description


def _snapshot_name(i: int) -> str:
    return f"snapshot_{i:03d}.h5"


@dataclasses.dataclass
class LoadedRun:
    """A run directory read back by :func:`load_run`.

    Attributes:
      directory: where it is.
      attrs: the run's metadata (``run.h5``'s root attributes).
      cosmology: the cosmological parameters.
      a, redshift: the snapshots' scale factors and redshifts.
      tree: ``{"main_branch", "mass"}`` (empty with one snapshot).
      lightcone: the halo light cone's fields (see :func:`~jaxpm_halos.lightcone`), or
        None when it was not written.
    """

    directory: str
    attrs: dict
    cosmology: dict
    a: np.ndarray
    redshift: np.ndarray
    tree: dict
    lightcone: dict | None = None

    def __len__(self) -> int:
        return len(self.a)

    def catalogue(self, snapshot: int) -> LoadedCatalogue:
        """Snapshot ``snapshot``'s catalogue."""
        return load_catalogue(self._path(snapshot))

    def links(self, snapshot: int) -> dict:
        """Snapshot ``snapshot``'s links, aligned with its catalogue's rows."""
        return self._group(snapshot, "links")

    def member_table(self, snapshot: int) -> dict:
        """Snapshot ``snapshot``'s whole member table: ``offset``, ``count``, ``ids``."""
        return self._group(snapshot, "members")

    def members(self, snapshot: int, halo_id: int) -> np.ndarray:
        """The sorted member ids of halo ``halo_id`` at ``snapshot``, read without the
        others' (raises KeyError for an id not in the catalogue)."""
        import h5py

        with h5py.File(self._path(snapshot), "r") as f:
            ids = f["id"][()]
            row = int(np.searchsorted(ids, halo_id))
            if row >= len(ids) or ids[row] != halo_id:
                raise KeyError(f"no halo {halo_id} at snapshot {snapshot}")
            start, count = int(f["members/offset"][row]), int(f["members/count"][row])
            return f["members/ids"][start : start + count]

    def _path(self, snapshot: int) -> str:
        if not -len(self) <= snapshot < len(self):
            raise IndexError(f"snapshot {snapshot}: the run holds {len(self)}")
        return os.path.join(self.directory, _snapshot_name(snapshot % len(self)))

    def _group(self, snapshot: int, name: str) -> dict:
        import h5py

        with h5py.File(self._path(snapshot), "r") as f:
            return {k: v[()] for k, v in f[name].items()}


def load_run(directory) -> LoadedRun:
    """Read a run directory written by :func:`write_run` (its catalogues, members and links
    are read on demand)."""
    import h5py

    directory = os.fspath(directory)
    path = os.path.join(directory, "run.h5")
    with h5py.File(path, "r") as f:
        if f.attrs.get("format") != FORMAT:
            raise ValueError(f"{path} is not a jaxpm_halos run file")
        plain = lambda attrs: {
            k: (v.item() if isinstance(v, np.generic) else v) for k, v in attrs.items()
        }
        return LoadedRun(
            directory,
            plain(f.attrs),
            plain(f["cosmology"].attrs),
            f["a"][()],
            f["redshift"][()],
            {k: v[()] for k, v in f["tree"].items()},
            {k: v[()] for k, v in f["lightcone"].items()} if "lightcone" in f else None,
        )
