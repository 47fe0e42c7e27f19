"""The one per-device pipeline behind ``fof``, ``knn``, ``knn_density`` and ``InSitu``.

A :class:`Plan` holds every buffer size of one decomposition, fixed on the host from the
config, the pencils, the mean rows per device ``n0`` and the ghost width; it is also the
one place their :class:`~.status.Limit` s are built. :func:`on_device` is the driver, run
inside ``shard_map``: it decomposes the particles once, runs each analysis on that
decomposition, makes one return trip for every per-particle output, and extends every
:class:`~.status.Status` an analysis returns with the decomposition's, so no result
reports ok when the buffers it depends on overflowed. :func:`run_sharded` builds the
``shard_map`` whose output specs follow the kinds the analyses declare.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from .config import CAPACITY, GHOSTS, IMAGES, TRANSFER, DomainConfig, Knob
from .domain import Decomposition, Migrated, decompose, migrate, return_trip, with_ghosts
from .errors import Limit
from .layout import Layout, Pencils, width_fraction
from .rows import pmax_all, pmin_all, psum_all
from .status import Status, is_status, is_traced

KINDS = ("particle", "device", "replicated")

# XLA:CPU's default scheduler starts independent work early, for concurrency, and so keeps
# more buffers live at once. Its memory-minimising scheduler runs these programs as fast,
# bit for bit, with far fewer temporaries (docs/performance.md has the measured figures).
_CPU_OPTIONS = {"xla_cpu_enable_concurrency_optimized_scheduler": False}


@functools.cache
def _compiler_options(backend: str):
    """:data:`_CPU_OPTIONS` on CPU where this jaxlib knows them, else None."""
    if backend != "cpu":
        return None
    try:
        jax.jit(lambda x: x + 1, compiler_options=_CPU_OPTIONS).lower(jnp.zeros(())).compile()
    except Exception:  # an XLA without the option: its default scheduler, as before
        return None
    return _CPU_OPTIONS


def compiler_options():
    """Options for the ``jax.jit`` of your own program that runs this library's analyses
    (a simulation step or solve with :class:`~jaxpm_halos.InSitu`):
    ``jax.jit(simulate, compiler_options=jaxpm_halos.compiler_options())``.

    On CPU it selects XLA's memory-minimising scheduler, as this library's own calls do
    outside ``jit``: XLA:CPU's default scheduler starts independent work early, for
    concurrency, and so keeps more buffers live at once. The results are the same bits
    (the docs' Performance page has the measured temporaries). Elsewhere, and with
    a jaxlib that does not know the option, it returns None: JAX's defaults.
    """
    options = _compiler_options(jax.default_backend())
    return None if options is None else dict(options)


class JitProgram:
    """``jax.jit(fn)`` for a program this library compiles for its calls: called outside
    any trace, it compiles with XLA:CPU's memory-minimising scheduler on CPU; called inside
    a user's ``jit`` (or ``grad``, ``vmap``), it is a plain nested ``jit``, since JAX takes
    compiler options from the outermost ``jit`` only (pass the same options to yours:
    ``jax.jit(..., compiler_options=...)``)."""

    def __init__(self, fn: Callable):
        self.plain = jax.jit(fn)
        self.top = jax.jit(fn, compiler_options=_compiler_options(jax.default_backend()))

    def __call__(self, *args):
        return (self.plain if is_traced(args) else self.top)(*args)

    def lower(self, *args):
        """The program as a call outside ``jit`` compiles it."""
        return self.top.lower(*args)

    def clear_cache(self):
        self.plain.clear_cache()
        self.top.clear_cache()


@dataclasses.dataclass(frozen=True)
class Plan:
    """Buffer sizes of one decomposition (static, hashable).

    Attributes:
      pencils: the pencil decomposition.
      domain: the :class:`~jaxpm_halos.DomainConfig` sizing the buffers.
      n0: mean input rows per device, the unit of the capacity factors.
      width: ghost layer width, in box units.
      grid: the input is a JaxPM grid (its particles stray little: smaller transfers).
      prefix: prefixed to buffer names (``"query "`` for query points).
    """

    pencils: Pencils
    domain: DomainConfig
    n0: int
    width: float
    grid: bool = False
    prefix: str = ""

    @property
    def transfer_rows(self) -> int:
        return self.domain.transfer_rows(self.n0, self.grid)

    @property
    def capacity_rows(self) -> int:
        return self.domain.capacity_rows(self.n0)

    @property
    def ghost_rows(self) -> int:
        return self.domain.ghost_rows(self.n0, width_fraction(self.pencils, self.width))

    @property
    def image_rows(self) -> int:
        """Rows per side for periodic images along z within ``width`` of the z faces."""
        return self.domain.image_rows(
            self.n0, width_fraction(self.pencils, self.width), self.width / self.pencils.box_size
        )

    def with_width(self, width: float) -> Plan:
        return dataclasses.replace(self, width=float(width))

    def limit(self, knob: Knob) -> Limit:
        """The :class:`Limit` of the buffer ``knob`` sizes."""
        rows = {
            TRANSFER: self.transfer_rows,
            CAPACITY: self.capacity_rows,
            GHOSTS: self.ghost_rows,
            IMAGES: self.image_rows,
        }[knob]
        return Limit(knob, rows, self.n0)

    def status(self, needs: dict, knobs: dict, nonfinite=None) -> Status:
        """A status of named buffers (``knobs`` maps each name to its knob), maxima over
        devices."""
        limits = tuple((self.prefix + name, self.limit(knobs[name])) for name in needs)
        needed = {
            self.prefix + name: value for name, value in pmax_all(self.pencils, needs).items()
        }
        nonfinite = jnp.int32(0) if nonfinite is None else psum_all(self.pencils, nonfinite)
        return Status(needed, nonfinite, limits)

    def migrate(self, fields: dict, valid) -> tuple[Migrated, Status]:
        """Send every valid row to its pencil (no ghosts); with the status of the move."""
        mig = migrate(self.pencils, fields, valid, self.transfer_rows, self.capacity_rows)
        status = self.status(
            {"transfer": mig.need_transfer, "capacity": mig.need_capacity},
            {"transfer": TRANSFER, "capacity": CAPACITY},
            mig.nonfinite,
        )
        return mig, status

    def decompose(self, fields: dict, valid) -> tuple[Decomposition, Status]:
        """Migration plus ghosts of ``width``; with the status of its three buffers."""
        dec = decompose(
            self.pencils,
            fields,
            valid,
            self.width,
            self.transfer_rows,
            self.capacity_rows,
            self.ghost_rows,
        )
        mig = dec.migrated
        needs = {
            "transfer": mig.need_transfer,
            "capacity": mig.need_capacity,
            "ghosts": dec.need_ghosts,
        }
        knobs = {"transfer": TRANSFER, "capacity": CAPACITY, "ghosts": GHOSTS}
        status = self.status(needs, knobs, mig.nonfinite)
        return dataclasses.replace(dec, fits=status.buffers_fit()), status

    def reghost(self, decomposition: Decomposition, name: str) -> tuple[Decomposition, Status]:
        """``decomposition``'s particles with ghosts of this plan's width, as buffer
        ``name`` (it fits where that buffer and the decomposition's own did)."""
        dec = with_ghosts(self.pencils, decomposition.migrated, self.width, self.ghost_rows)
        status = self.status({name: dec.need_ghosts}, {name: GHOSTS})
        return dataclasses.replace(dec, fits=decomposition.fits & status.buffers_fit()), status

    def trip(self, values, migrated: Migrated, input_rows: int):
        """Per-row ``values`` of the migrated rows back to the input rows, in one set of
        moves. Rows that never arrived (non-finite positions, padding) hold NaN for floats,
        -1 for integers and False for booleans."""
        arrived = jnp.ones(migrated.payload["id"].shape, bool)
        packed, unpack = pack_rows((values, arrived))
        back, arrived = unpack(
            return_trip(
                self.pencils,
                packed,
                migrated.payload["origin"],
                migrated.count,
                input_rows,
                self.transfer_rows,
                self.capacity_rows,
            )
        )
        return blank_rows(back, arrived)


def blank_rows(tree, kept):
    """Every leaf of ``tree`` (rows along axis 0) with the rows where ``kept`` (n,) is
    False set to NaN for floats, -1 for integers (the largest value for unsigned ones) and
    False for booleans: never a value that looks right."""
    return jax.tree.map(lambda a: _blank(a, kept), tree)


def _blank(a, kept):
    mask = kept.reshape(kept.shape + (1,) * (a.ndim - 1))
    if jnp.issubdtype(a.dtype, jnp.inexact):
        fill = jnp.nan
    elif a.dtype == jnp.bool_:
        fill = False
    elif jnp.issubdtype(a.dtype, jnp.unsignedinteger):
        fill = jnp.iinfo(a.dtype).max
    else:
        fill = -1
    return jnp.where(mask, a, jnp.asarray(fill, a.dtype))


def plan_for(problem, domain: DomainConfig, width: float) -> Plan:
    """The plan of a public call's :class:`~.frontend.Problem`."""
    layout = problem.layout
    return Plan(layout.pencils, domain, layout.local_size, float(width), layout.grid)


class Step(NamedTuple):
    """One analysis in the pipeline.

    Attributes:
      run: ``run(decomposition) -> pytree`` on one device.
      outputs: a prefix tree of output kinds: ``"particle"`` (one value per owned row, sent
        back to the input's layout), ``"device"`` (stacked over devices along axis 0) or
        ``"replicated"``. Every :class:`~.status.Status` inside is replicated.
    """

    run: Callable[[Decomposition], Any]
    outputs: Any


def analyse(decomposition: Decomposition, domain: Status, steps: dict):
    """Run each step on one decomposition; every Status they return is extended with the
    decomposition's ``domain`` status. Returns ``(outputs, kinds)``, both keyed like
    ``steps``, ``kinds`` with one kind per leaf."""
    outputs, kinds = {}, {}
    for name, step in steps.items():
        out = jax.tree.map(
            lambda s: domain.merge(s) if is_status(s) else s,
            step.run(decomposition),
            is_leaf=is_status,
        )
        outputs[name] = out
        try:
            kinds[name] = leaf_kinds(step.outputs, out)
        except ValueError as error:  # a tree mismatch, raised by JAX without the name
            raise ValueError(
                f"analysis {name!r}: its declared outputs={step.outputs!r} (a "
                "prefix tree of kinds) does not match the tree it returned, "
                f"{jax.tree.structure(out)}; declare a kind for every key it "
                f"returns ({error})"
            ) from None
        _check_output_shapes(name, out, kinds[name], decomposition.migrated.valid.shape[0])
    return outputs, kinds


def _check_output_shapes(name: str, out, kinds, rows: int):
    """An analysis's leaves fit their kinds: a ``"particle"`` leaf has one row per owned
    row (``rows``), a ``"device"`` leaf at least one axis (its rows are stacked over the
    devices). Checked at trace time, so the message names the analysis and the leaf."""
    paths = jax.tree_util.tree_flatten_with_path(out)[0]
    for (path, leaf), kind in zip(paths, jax.tree.leaves(kinds)):
        shape = tuple(jnp.shape(leaf))
        where = f"analysis {name!r}, output {jax.tree_util.keystr(path) or 'value'}"
        if kind == "particle" and (not shape or shape[0] != rows):
            raise ValueError(
                f"{where}: a 'particle' output needs one row per owned row of "
                f"the snapshot, shape ({rows}, ...); got {shape}"
            )
        if kind == "device" and not shape:
            raise ValueError(
                f"{where}: a 'device' output needs a leading axis (e.g. value[None]); got a scalar"
            )


def on_device(plan: Plan, fields: dict, valid, block_shape, steps: dict):
    """The pipeline on one device's input rows: decompose, analyse, one return trip.

    Returns ``(outputs, kinds)`` as :func:`analyse`, plus the ``"domain"`` status; the
    per-particle leaves come back in the input block's shape ``block_shape``.
    """
    decomposition, domain = plan.decompose(fields, valid)
    outputs, kinds = analyse(decomposition, domain, steps)
    leaves, treedef = jax.tree.flatten(outputs)
    flat_kinds = jax.tree.leaves(kinds)
    rows = {i: leaf for i, (leaf, kind) in enumerate(zip(leaves, flat_kinds)) if kind == "particle"}
    back = plan.trip(rows, decomposition.migrated, valid.shape[0])
    leaves = [
        back[i].reshape(tuple(block_shape) + back[i].shape[1:]) if i in back else leaf
        for i, leaf in enumerate(leaves)
    ]
    outputs = jax.tree.unflatten(treedef, leaves)
    return ({**outputs, "domain": domain}, {**kinds, "domain": leaf_kinds("replicated", domain)})


def run_sharded(layout: Layout, device: Callable, args, in_specs):
    """``device(*blocks) -> (outputs, kinds)`` on every device, with each output leaf's
    sharding given by its kind. Call inside ``jit``."""
    structure = {}

    def split(*blocks):
        outputs, kinds = device(*blocks)
        leaves, structure["tree"] = jax.tree.flatten(outputs)
        structure["kinds"] = jax.tree.leaves(kinds)
        return tuple([x for x, k in zip(leaves, structure["kinds"]) if k == kind] for kind in KINDS)

    specs = (layout.spec, layout.device_spec, P())
    parts = layout.run(split, args, in_specs, specs)
    by_kind = {kind: iter(part) for kind, part in zip(KINDS, parts)}
    return jax.tree.unflatten(structure["tree"], [next(by_kind[k]) for k in structure["kinds"]])


def leaf_kinds(declared, result):
    """One kind per leaf of ``result``: ``declared`` (a prefix tree of kinds) expanded,
    except that every leaf of a :class:`Status` is replicated (its needs are already
    maxima over devices)."""

    def expand(kind, sub):
        if kind not in KINDS:
            raise ValueError(f"output kind must be one of {KINDS}, got {kind!r}")
        return jax.tree.map(
            lambda s: jax.tree.map(lambda _: "replicated", s) if is_status(s) else kind,
            sub,
            is_leaf=is_status,
        )

    expanded = jax.tree.map(expand, declared, result, is_leaf=lambda x: isinstance(x, str))
    return jax.tree.unflatten(jax.tree.structure(result), jax.tree.leaves(expanded))


def replication_status(pencils: Pencils, outputs: dict, declared: dict) -> Status:
    """A status flagging each output leaf declared ``"replicated"`` (``declared`` maps
    analysis names to their prefix trees of kinds) whose bits differ between devices: this
    library's ``shard_map`` does not check replication, so such a leaf would come back as
    one device's value. Statuses inside are skipped (they are maxima over devices). Costs
    one ``pmin`` and one ``pmax`` per leaf; on one device the flags are constant False."""
    names, flags = [], []
    for name, out in outputs.items():
        plain = jax.tree.map(lambda x: None if is_status(x) else x, out, is_leaf=is_status)
        paths = jax.tree_util.tree_flatten_with_path(plain)[0]
        for (path, leaf), kind in zip(paths, jax.tree.leaves(leaf_kinds(declared[name], plain))):
            if kind == "replicated":
                bits = _bits(leaf)
                flags.append(jnp.any(pmin_all(pencils, bits) != pmax_all(pencils, bits)))
                names.append(f"analysis {name!r}, output {jax.tree_util.keystr(path) or 'value'}")
    unreplicated = jnp.stack(flags) if flags else jnp.zeros((0,), bool)
    return Status({}, jnp.int32(0), (), unreplicated, tuple(names))


def _bits(x):
    """``x`` as integers of the same bits (bools as int32), compared exactly: NaN equals
    the same NaN and -0.0 differs from 0.0."""
    x = jnp.asarray(x)
    if x.dtype == bool:
        return x.astype(jnp.int32)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag])
    if jnp.issubdtype(x.dtype, jnp.floating):
        return lax.bitcast_convert_type(x, jnp.dtype(f"int{8 * x.dtype.itemsize}"))
    return x


def pack_rows(tree):
    """Pack per-row arrays into one float32 (n, a) and one int32 (n, b) array, so that
    moving them costs one set of operations each (floats stay floats: gradients flow);
    other dtypes travel as they are. Returns ``(packed, unpack)``."""
    leaves, treedef = jax.tree.flatten(tree)
    n = leaves[0].shape[0]
    floats, ints, other, layout = [], [], [], []
    for leaf in leaves:
        if leaf.dtype == jnp.float32:
            layout.append(("f", leaf.shape, leaf.dtype, sum(c.shape[1] for c in floats)))
            floats.append(leaf.reshape(n, -1))
        elif leaf.dtype == jnp.bool_ or leaf.dtype in (jnp.int32, jnp.uint32):
            layout.append(("i", leaf.shape, leaf.dtype, sum(c.shape[1] for c in ints)))
            ints.append(leaf.reshape(n, -1).astype(jnp.int32))
        else:
            layout.append(("o", leaf.shape, leaf.dtype, len(other)))
            other.append(leaf)
    cat = lambda cols, dtype: jnp.concatenate(cols, axis=1) if cols else jnp.zeros((n, 0), dtype)
    packed = (cat(floats, jnp.float32), cat(ints, jnp.int32), other)

    def unpack(moved):
        fblock, iblock, rest = moved
        out = []
        for kind, shape, dtype, start in layout:
            if kind == "o":
                out.append(rest[start])
                continue
            width = 1
            for s in shape[1:]:
                width *= s
            block = fblock if kind == "f" else iblock
            flat = block[:, start : start + width]
            if kind == "i":
                flat = flat > 0 if dtype == jnp.bool_ else flat.astype(dtype)
            out.append(flat.reshape((block.shape[0],) + shape[1:]))
        return jax.tree.unflatten(treedef, out)

    return packed, unpack
