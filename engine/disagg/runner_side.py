"""The runner's side of disaggregated prefill: a request's rows gathered out of, and pulled
rows scattered into, the cache it owns (engine/kv_rows.py does the moving).

A multi-process engine (mesh.num_processes > 1) holds its cache in shards on every
process, so a gather or scatter is one program all of them run. Process 0 alone talks
to the other engine (its transfer server offers and pulls: engine/disagg/transfer.py),
so it announces each one to the followers first (KV_EXPORT, KV_IMPORT lockstep messages)
and they run the same program:

* export: the gather leaves a whole copy of the rows on every device (all-gathered from
  whichever processes hold the pages); process 0 offers its copy, the others drop theirs.
* import: the pulled rows exist on process 0 only; every process runs one collective that
  takes process 0's copy (the others contribute zeros of the announced shape) onto every
  device, then the scatter.

Process 0 gathers rather than every process offering its own shards: the decode side
then pulls one set of token-major rows whatever either side's mesh, as with one process.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxfill.engine import kv_rows
from jaxfill.engine.lockstep import KV_EXPORT, KV_IMPORT

# dtypes of pulled rows, as one lockstep word each
DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2")


class RunnerDisagg:
    """Mixin of Runner (engine/runner.py): reads its kv_cache, lockstep, mesh, page_size."""

    def export_rows(self, pages: list[int], num_tokens: int, num_kv_heads: int):
        """A request's first num_tokens K/V rows as one-device arrays (values, scales or
        None) for a disaggregated pull; `pages` are ids of the cache's page axis."""
        if self.lockstep is not None:
            self.lockstep.send(KV_EXPORT, words=np.asarray([num_tokens, num_kv_heads, *pages], np.int32))
        return self._export(pages, num_tokens, num_kv_heads)

    def _export(self, pages, num_tokens: int, num_kv_heads: int):
        with self.mesh_context():
            return kv_rows.export_rows(self.kv_cache, list(pages), num_tokens, self.page_size, num_kv_heads,
                                       replicate=self.lockstep is not None)

    def import_rows(self, values, scales, pages: list[int], num_tokens: int) -> None:
        """Pulled rows scattered into `pages` of the cache (which is donated and replaced)."""
        self.save_evicted()
        if self.lockstep is not None:
            specs = [values] + ([] if scales is None else [scales])
            words = [num_tokens, len(pages), *pages, len(specs)]
            for a in specs:
                words += [DTYPES.index(str(a.dtype)), a.ndim, *a.shape]
            self.lockstep.send(KV_IMPORT, words=np.asarray(words, np.int32))
            values, scales = self._from_leader(values), None if scales is None else self._from_leader(scales)
        self._scatter(values, scales, pages, num_tokens)

    def _scatter(self, values, scales, pages, num_tokens: int) -> None:
        with self.mesh_context():
            self.kv_cache = kv_rows.import_rows(self.kv_cache, values, scales, list(pages), num_tokens,
                                                self.page_size)

    def _from_leader(self, a, shape=None, dtype=None):
        """Process 0's array (`a`; None on the others, which give its shape and dtype)
        replicated over the cache's mesh on every process."""
        return from_process_0(a, shape, dtype, self.mesh)

    def _follow_disagg(self, op: int, words: np.ndarray) -> None:
        """Follower: process 0's export or import, run here on this process's shards."""
        w = [int(x) for x in words]
        if op == KV_EXPORT:
            self._export(w[2:], w[0], w[1])
            return
        num_tokens, n = w[0], w[1]
        pages, at = w[2:2 + n], 2 + n
        arrays = []
        for _ in range(w[at]):
            dtype, ndim = DTYPES[w[at + 1]], w[at + 2]
            shape = tuple(w[at + 3:at + 3 + ndim])
            arrays.append(self._from_leader(None, shape, dtype))
            at += 2 + ndim
        self.save_evicted()
        self._scatter(arrays[0], arrays[1] if len(arrays) > 1 else None, pages, num_tokens)


@functools.lru_cache(maxsize=None)
def _process_rows():
    """(sharding of a [processes, ...] array, one row per process; the jitted take of row 0
    onto every device): the collective an import runs, built once."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxfill.engine.mesh import ordered_devices

    devices = np.array(ordered_devices()).reshape(jax.process_count(), jax.local_device_count())
    mesh = Mesh(devices, ("processes", "local"))
    take = jax.jit(lambda x: x[0], out_shardings=NamedSharding(mesh, PartitionSpec()))
    return NamedSharding(mesh, PartitionSpec("processes")), take


def from_process_0(a, shape, dtype, mesh) -> jax.Array:
    """Every process calls it at the same point: process 0's `a` (the others pass None and
    its shape and dtype) as one array replicated over `mesh`, each process's copy built
    from the shards that landed on its own devices."""
    rows, take = _process_rows()
    local = np.asarray(a) if a is not None else np.zeros(shape, jnp.dtype(dtype))
    whole = take(jax.make_array_from_process_local_data(rows, local[None]))
    target = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    mine = {s.device: s.data for s in whole.addressable_shards}
    return jax.make_array_from_single_device_arrays(local.shape, target,
                                                    [mine[d] for d in target.addressable_devices])
