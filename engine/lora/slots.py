"""Adapters by name: host copies (an LRU of lora.max_cpu_loras) and the device slot
tables (lora.max_loras slots, an LRU over those no running request holds).

A request names its adapter; `acquire` gives it a slot when it is added (writing the
adapter into the least recently used free slot if it is not on the device) and the
request keeps that slot while it lives: a slot is free when no unfinished request holds
it. So the step never waits on a load, and a batch mixes base rows (slot 0) and the rows
of up to max_loras adapters. When every slot is held by running requests a new adapter's
request is refused with QueueFull (Engine.generate steps and retries; a server answers
RESOURCE_EXHAUSTED).

Writing a slot replaces the tables' arrays with arrays of the same shape, dtype and
sharding: data, so no step recompiles (tests/test_lora.py counts). An adapter's key
(name and a digest of its files) is mixed into its requests' prefix hashes
(engine/scheduler/prefix_lookup.py): pages computed under one adapter are never another
adapter's, nor the base model's, nor those of other files loaded later under the same name.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading

import jax
import numpy as np

from jaxfill.engine.lora.adapter import Adapter, AdapterError, read_adapter
from jaxfill.engine.lora.peft_config import CONFIG_FILE, WEIGHTS_FILE
from jaxfill.engine.request import InvalidRequest, QueueFull
from jaxfill.models.lora import slot_axes, table_leaves


def fingerprint(path: str) -> str:
    """A digest of the adapter's files: its prefix-hash key, so pages are shared only by the
    same weights (a name reloaded from other files is another key, also in the disk tier,
    which outlives the process)."""
    h = hashlib.blake2b(digest_size=8)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        with open(os.path.join(path, file), "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _axis(key: str) -> int:  # "layer.projection.a" -> the slot axis of that table (models/lora.slot_axes)
    _, proj, half = key.split(".")
    return slot_axes(proj)[half == "b"]


def _write_rows(tables: dict, row: jax.Array, values: dict) -> dict:  # row: [] i32 table row (slot - 1)
    return {k: jax.lax.dynamic_update_index_in_dim(t, values[k].astype(t.dtype), row, _axis(k))
            for k, t in tables.items()}


class LoraSlots:
    def __init__(self, settings, runner):
        self.settings = settings
        self.runner = runner  # its state holds the tables (models/lora.py attach_tables)
        leaves = table_leaves(runner.state)
        if not leaves:
            raise ValueError("lora.max_loras > 0 but the model holds no LoRA tables (models/lora.attach_tables)")
        # (layer, projection) -> (in dims, out dims, experts or 0): what an adapter's tensors must fit
        self.shapes = {key: ((a.shape[1],), b.shape[3:], a.shape[0]) if key[1].startswith("experts_")
                       else (a.shape[1:-1], b.shape[2:], 0) for key, (a, b) in leaves.items()}
        self.dtype = np.dtype(next(iter(leaves.values()))[0].dtype)
        flat = self._flat(leaves)
        self._write = jax.jit(_write_rows, out_shardings={k: v.sharding for k, v in flat.items()})
        self._zeros = {k: np.zeros(v.shape[:_axis(k)] + v.shape[_axis(k) + 1:], self.dtype) for k, v in flat.items()}
        self.paths: dict[str, str] = {}  # every loaded adapter's directory
        self.keys: dict[str, str] = {}  # name -> its key in prefix hashes (name and load number)
        self.host: collections.OrderedDict[str, Adapter] = collections.OrderedDict()  # LRU, oldest first
        self.names: list[str | None] = [None] * settings.max_loras  # slot s holds names[s - 1]
        self.used: collections.OrderedDict[str, None] = collections.OrderedDict()  # device LRU, oldest first
        self.num_loads = 0  # adapters read from disk
        self.num_writes = 0  # slots written
        self._lock = threading.Lock()

    @staticmethod
    def _flat(leaves) -> dict[str, jax.Array]:
        out = {}
        for (layer, proj), (a, b) in leaves.items():
            out[f"{layer}.{proj}.a"], out[f"{layer}.{proj}.b"] = a[...], b[...]
        return out

    # ---------------------------------------------------------------- host side
    def load(self, name: str, path: str) -> dict:
        """Reads and checks the adapter (AdapterError names what is refused); a name already
        loaded must be unloaded first. Returns its description."""
        if not isinstance(name, str) or not name:
            raise InvalidRequest("lora", f"an adapter name must be a non-empty string, got {name!r}")
        with self._lock:
            if name in self.paths:
                raise InvalidRequest("lora", f"adapter {name!r} is already loaded (from {self.paths[name]}); "
                                             "unload it first")
            adapter = self._read(name, path)
            self.paths[name], self.keys[name] = path, f"{name}#{fingerprint(path)}"
            self._keep(adapter)
            return self._describe(name)

    def _read(self, name: str, path: str) -> Adapter:
        adapter = read_adapter(name, path, self.shapes, self.settings.max_lora_rank, self.dtype)
        self.num_loads += 1
        return adapter

    def _keep(self, adapter: Adapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.settings.host_capacity:  # re-read from its directory when used again
            self.host.popitem(last=False)

    def unload(self, name: str, live_slots: set[int]) -> bool:
        """Forgets the adapter; refused while an unfinished request uses it. False if unknown."""
        with self._lock:
            if name not in self.paths:
                return False
            slot = self.slot_of(name)
            if slot and slot in live_slots:
                raise InvalidRequest("lora", f"adapter {name!r} is in use by running requests; abort or finish "
                                             "them first")
            if slot:
                self.names[slot - 1] = None
                self.used.pop(name, None)
            del self.paths[name], self.keys[name]
            self.host.pop(name, None)
            return True

    def list(self) -> list[dict]:
        with self._lock:
            return [self._describe(name) for name in self.paths]

    def _describe(self, name: str) -> dict:
        return {"name": name, "path": self.paths[name], "slot": self.slot_of(name), "on_host": name in self.host}

    def known(self, name: str) -> bool:
        """Loaded under that name (a dict read: the serving thread asks without the lock)."""
        return name in self.paths

    def names_loaded(self) -> list[str]:
        return sorted(self.paths)

    def slot_of(self, name: str) -> int:
        return self.names.index(name) + 1 if name in self.names else 0

    # ---------------------------------------------------------------- device slots
    def acquire(self, lora, live_slots: set[int]) -> tuple[int, str]:
        """(slot, key) for a request naming `lora` (a name, or (name, path) loaded now if the
        name is new); `live_slots`: the slots unfinished requests hold."""
        if isinstance(lora, tuple):
            name, path = lora
            if name not in self.paths:
                self.load(name, path)
            elif self.paths[name] != path:
                raise InvalidRequest("lora", f"adapter {name!r} is loaded from {self.paths[name]}, not {path}")
        else:
            name = lora
        with self._lock:
            if name not in self.paths:
                known = ", ".join(sorted(self.paths)) or "none"
                raise InvalidRequest("lora", f"unknown adapter {name!r} (loaded: {known}); Engine.load_lora first")
            slot = self.slot_of(name)
            if not slot:
                slot = self._free_slot(name, live_slots)
                self._fill(slot, name)
            self.used[name] = None
            self.used.move_to_end(name)
            return slot, self.keys[name]

    def _free_slot(self, name: str, live_slots: set[int]) -> int:
        if None in self.names:
            return self.names.index(None) + 1
        for victim in self.used:  # least recently used first
            slot = self.slot_of(victim)
            if slot not in live_slots:
                self.names[slot - 1] = None
                del self.used[victim]
                return slot
        raise QueueFull(f"all {len(self.names)} LoRA slots (lora.max_loras) hold adapters of running requests; "
                        f"adapter {name!r} waits for one to finish")

    def _fill(self, slot: int, name: str) -> None:
        adapter = self.host.get(name)
        if adapter is None:
            try:
                adapter = self._read(name, self.paths[name])
            except (AdapterError, OSError) as e:
                raise InvalidRequest("lora", f"adapter {name!r} could not be re-read: {e}") from None
        self._keep(adapter)
        values = dict(self._zeros)
        for (layer, proj), (a, b) in adapter.tensors.items():
            values[f"{layer}.{proj}.a"], values[f"{layer}.{proj}.b"] = a, b
        self.write(slot, values)
        self.names[slot - 1] = name

    def write(self, slot: int, values: dict[str, np.ndarray]) -> None:
        """Slot `slot`'s rows of every table replaced (one jitted program for all of them)."""
        leaves = table_leaves(self.runner.state)  # the runner may have rebuilt its state (warm-up's impl check)
        with self.runner.mesh_context():
            new = self._write(self._flat(leaves), np.int32(slot - 1), values)
        for (layer, proj), (a, b) in leaves.items():
            a.set_value(new[f"{layer}.{proj}.a"])
            b.set_value(new[f"{layer}.{proj}.b"])
        self.num_writes += 1

    def warm(self) -> None:
        """Compiles the slot writer (zeros into slot 1, which holds nothing yet), so a
        request's first adapter does not wait for a compile."""
        self.write(1, self._zeros)
        self.num_writes = 0

    def stats(self) -> dict:
        with self._lock:
            return {"lora_loaded": len(self.paths), "lora_on_device": sum(n is not None for n in self.names),
                    "lora_slots": len(self.names), "lora_reads": self.num_loads, "lora_slot_writes": self.num_writes}
