"""A correct reverse-mode adjoint for JaxPM's distributed halo exchange (issue #21).

jaxdecomp 0.2.9 (the version JaxPM 0.1.6 runs distributed with) implements the halo
exchange as a primitive whose per-device program reads the edge slabs of each local block
and *sets* them, by ``ppermute``, into the neighbours' halo slabs. Per device, for a
padded block ``b`` of shape ``(bx, by, nz)`` (the halos included) and extents
``(ex, ey)``::

    out[:ex]  <- lower neighbour's b[-2ex:-ex]     out[-ex:] <- upper neighbour's b[ex:2ex]
    (the same along y, then the four corners through both axes; every other cell unchanged)

JaxPM uses it twice. ``cic_paint_dx`` paints into a block padded by ``halo_size`` cells,
exchanges with extent ``halo_size // 2`` and then ``slice_unpad`` adds the outer halves of
the padding onto the interior and crops: mass painted into the inner half of a device's
padding reaches the neighbour. ``cic_read_dx`` pads by ``halo_size // 2``, exchanges, and
reads the neighbours' edges from the halo.

The exchange is linear, so its adjoint is its transpose: zero the cotangent of every halo
cell that the exchange overwrote, and ``ppermute`` each halo slab's cotangent back to the
device it came from, adding it onto that device's edge slab. jaxdecomp registers the
exchange itself as the transpose (as if it were self-adjoint): it copies the edges'
cotangent into the neighbours' halos, where the adjoint adds the halos' cotangent onto the
neighbours' edges, so the adjoints of painting and reading come out wrong wherever
particles sit near a device edge.

:func:`correct_jaxpm_adjoints` replaces that transpose rule. The replacement binds a new
linear primitive whose per-device program is ``jax.linear_transpose`` of jaxdecomp's own
per-device exchange (``ppermute``, slicing and ``set``: JAX transposes each exactly), so it
mirrors whatever the forward does (slabs, pencils, corners, periodicity) by construction.
The forward exchange is not touched: forward results stay bitwise JaxPM's.

Nothing here imports jaxpm or jaxdecomp at module import; :func:`correct_jaxpm_adjoints`
imports jaxdecomp when called.
"""

from __future__ import annotations

import functools
import importlib.metadata
import threading

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

#: The only jaxdecomp version whose halo primitive this module was checked against.
TESTED_JAXDECOMP = "0.2.9"

_LOCK = threading.Lock()
_INSTALLED: dict = {}  # "forward" (jaxdecomp's primitive) and "adjoint" once installed


def correct_jaxpm_adjoints() -> bool:
    """Make reverse mode through a distributed JaxPM run correct. Call once, before tracing.

    Registers a correct transpose for jaxdecomp's halo-exchange primitive, the only
    communication in JaxPM's CIC painting and reading (``cic_paint_dx``, ``cic_read_dx``,
    and the absolute ``cic_paint``, ``cic_read``). After the call, ``jax.grad``,
    ``jax.vjp`` and diffrax's default adjoint through ``lpt`` and ``make_diffrax_ode``
    agree with forward mode and with one device (tested for ``cic_paint_dx``,
    ``cic_read_dx`` and whole solves). Forward values (and forward-mode derivatives) are
    unchanged.

    The first call clears JAX's tracing and compilation caches (``jax.clear_caches()``):
    JAX caches the transpose of a jitted function such as ``cic_paint_dx`` by its jaxpr, so
    a gradient traced earlier would otherwise keep jaxdecomp's rule. Calling it once at
    start-up, before tracing, avoids recompiling what was already compiled.

    Idempotent: a second call does nothing and returns False.

    Returns:
      True if this call installed the rule, False if it was already installed.

    Raises:
      RuntimeError: if the installed jaxdecomp is not version 0.2.9 (the rule is written
        against that version's private halo primitive), or jaxdecomp is missing.
    """
    with _LOCK:
        if _INSTALLED:
            return False
        halo = _jaxdecomp_halo_module()
        adjoint = _make_adjoint_primitive(halo)
        _register_transposes(halo, adjoint)
        # JAX caches transposed jaxprs (and compiled programs) by the forward jaxpr: a
        # gradient traced before this call would keep the old rule. Drop those caches once.
        jax.clear_caches()
        _INSTALLED.update(forward=halo.spmd_halo_primitive.primitive, adjoint=adjoint)
        return True


def _jaxdecomp_halo_module():
    """jaxdecomp's JAX halo module, after checking the installed version is the tested one."""
    try:
        found = importlib.metadata.version("jaxdecomp")
    except importlib.metadata.PackageNotFoundError as err:
        raise RuntimeError(
            f"correct_jaxpm_adjoints needs jaxdecomp {TESTED_JAXDECOMP} "
            "(JaxPM's halo exchange); it is not installed"
        ) from err
    if found != TESTED_JAXDECOMP:
        raise RuntimeError(
            f"correct_jaxpm_adjoints patches the private halo-exchange primitive of jaxdecomp "
            f"{TESTED_JAXDECOMP}, and jaxdecomp {found} is installed. Its halo primitive may "
            "differ (or be fixed): the patch is refused rather than risk a wrong gradient. "
            f"Install jaxdecomp=={TESTED_JAXDECOMP}, or check reverse mode against forward "
            "mode on your version (tests/test_adjoint.py does)."
        )
    from jaxdecomp._src.jax import halo

    if not hasattr(halo, "spmd_halo_primitive") or not hasattr(halo, "per_shard_impl"):
        raise RuntimeError(f"jaxdecomp {found} lacks the halo primitive this patch expects")
    return halo


def _spatial_axes(mesh):
    """Mesh axis names for array axes 0 and 1, as jaxdecomp's forward picks them.

    jaxdecomp maps the block's first axis to the mesh's first axis name and the second to
    the second (``None`` on a one-axis mesh); the adjoint must use the same pair to be the
    forward's transpose.
    """
    names = tuple(mesh.axis_names)
    if len(names) > 2:
        raise ValueError(f"JaxPM's halo exchange supports meshes of at most 2 axes, got {names}")
    return names + (None,) * (2 - len(names))


def _block_sharding(mesh, ndim):
    """The layout jaxdecomp's exchange assumes: spatial axes 0, 1 over the mesh axes in order.

    ``ndim`` is 3 for a ``(nx, ny, nz)`` field or 4 for a batch ``(b, nx, ny, nz)``.
    """
    return NamedSharding(mesh, P(*((None,) * (ndim - 3) + _spatial_axes(mesh) + (None,))))


def _adjoint_per_shard(ct, *, per_shard_impl, halo_extents, halo_periods, x_axis, y_axis):
    """Transpose of jaxdecomp's per-device exchange, applied to one device's cotangent.

    ``ct``: this device's padded block cotangent ``(bx, by, nz)`` or ``(b, bx, by, nz)``,
    inside the per-device program (axis names bound). Returns the same shape.
    """
    exchange = functools.partial(
        per_shard_impl,
        halo_extents=halo_extents,
        halo_periods=halo_periods,
        x_axis_name=x_axis,
        y_axis_name=y_axis,
    )
    # ppermute transposes to the inverse permutation and .at[].set to "zero the overwritten
    # cells, send their cotangent to the source": exactly the adjoint described above.
    (out,) = jax.linear_transpose(exchange, jax.ShapeDtypeStruct(ct.shape, ct.dtype))(ct)
    return out


def _partitioned_adjoint(per_shard_impl):
    """The adjoint as a ``custom_partitioning`` function: global ``(.., nx_pad, ny_pad, nz)``
    cotangent in, same shape and sharding out; each device runs :func:`_adjoint_per_shard`."""
    from jax.experimental.custom_partitioning import custom_partitioning

    def unpartitioned(ct, halo_extents, halo_periods):
        # Without a mesh, jaxdecomp's exchange is the identity (it returns its input), and
        # so is its transpose.
        del halo_extents, halo_periods
        return ct

    adjoint = custom_partitioning(unpartitioned, static_argnums=(1, 2))

    def infer_sharding(halo_extents, halo_periods, mesh, arg_infos, result_info):
        return _block_sharding(mesh, len(arg_infos[0].shape))

    def partition(halo_extents, halo_periods, mesh, arg_infos, result_info):
        # Ask for the layout the forward exchange assumed, whatever layout the cotangent
        # arrived in: XLA reshards it if propagation chose another.
        sharding = _block_sharding(mesh, len(arg_infos[0].shape))
        x_axis, y_axis = _spatial_axes(mesh)
        impl = functools.partial(
            _adjoint_per_shard,
            per_shard_impl=per_shard_impl,
            halo_extents=halo_extents,
            halo_periods=halo_periods,
            x_axis=x_axis,
            y_axis=y_axis,
        )
        return mesh, impl, sharding, (sharding,)

    def sharding_rule(halo_extents, halo_periods, mesh, arg_infos, result_info):
        # Shardy: elementwise in layout (each device keeps its block).
        dims = " ".join("bijk"[4 - len(arg_infos[0].shape) :])
        return f"{dims} -> {dims}"

    adjoint.def_partition(
        partition, infer_sharding_from_operands=infer_sharding, sharding_rule=sharding_rule
    )
    return adjoint


def _make_adjoint_primitive(halo):
    """A linear primitive ``adjoint(ct, halo_extents, halo_periods)``: the transpose of
    jaxdecomp's ``halo``-module exchange, for fields ``(nx, ny, nz)`` or ``(b, nx, ny, nz)``.

    It is a primitive (not a bare ``custom_partitioning`` call) so that it batches under
    ``vmap`` and transposes back to the forward exchange (reverse-over-reverse).
    """
    from jax._src import dispatch
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    forward = halo.spmd_halo_primitive.primitive
    partitioned = _partitioned_adjoint(halo.per_shard_impl)
    prim = Primitive("jaxpm_halos_halo_exchange_adjoint")
    # Like jaxdecomp's primitive, it lowers through custom_partitioning, which needs the
    # devices while lowering.
    dispatch.prim_requires_devices_during_lowering.add(prim)
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(lambda ct, **params: ct)
    mlir.register_lowering(
        prim,
        mlir.lower_fun(
            lambda ct, *, halo_extents, halo_periods: partitioned(ct, halo_extents, halo_periods),
            multiple_results=False,
        ),
    )

    def batch(args, dims, **params):
        # The per-device exchange handles one leading batch axis, like the forward's rule.
        (ct,), (dim,) = args, dims
        return prim.bind(jax.numpy.moveaxis(ct, dim, 0), **params), 0

    batching.primitive_batchers[prim] = batch
    # Linear: its JVP applies it to the tangent, and its transpose is the forward exchange.
    ad.deflinear2(prim, lambda ct, x, **params: [forward.bind(ct, **params)])
    return prim


def _register_transposes(halo, adjoint):
    """Replace the transpose of jaxdecomp's exchange primitive by ``adjoint``."""
    from jax.interpreters import ad

    forward = halo.spmd_halo_primitive.primitive

    def transpose(ct, x, **params):
        if type(ct) is ad.Zero:
            return [ad.Zero(x.aval.to_tangent_aval())]
        return [adjoint.bind(ct, **params)]

    ad.primitive_transposes[forward] = transpose
