"""Per-layer attention settings as data: one small array per layer, indexed by the layer's
number, so the stacked layouts (engine.scan_layers, mesh.stage), whose layer number is a
traced value, run models whose layers differ (Gemma 3's 5 sliding : 1 full, SmolLM3's
NoPE layers) with no Python branch per layer.

The window stays a static kernel argument: (sliding window, attention chunk), each None
or an int; a model has one or two distinct windows, and a traced layer picks among them
with `lax.switch` (attention only).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfill.models.config import ModelConfig
from jaxfill.models.rope import rope_parameters


class LayerSettings(NamedTuple):
    windows: tuple  # the distinct (sliding window, attention chunk) pairs ((None, None): full), static
    window_index: np.ndarray  # [L] int32 into `windows`
    inv_freq: np.ndarray  # [L, D/2] f32 (zeros on a NoPE layer; a narrower layer's zero-padded to the widest)
    rope_scale: np.ndarray  # [L] f32 cos/sin multiplier
    has_rope: np.ndarray  # [L] bool
    temperature: np.ndarray  # [L] f32 query temperature beta (0: none on that layer)
    rope_pairs: np.ndarray  # [L] int32: the pairs of `layer`'s own head (Gemma 4's wider global heads)

    def rope(self, layer):
        """(inv_freq [D/2], scale []) of `layer`: numpy for a Python int, traced otherwise
        (a stacked layout: its layers share one shape)."""
        if isinstance(layer, int):
            return self.inv_freq[layer][:self.rope_pairs[layer]], float(self.rope_scale[layer])
        return jnp.take(jnp.asarray(self.inv_freq), layer, axis=0), jnp.take(jnp.asarray(self.rope_scale), layer)

    def of_layer(self, table: np.ndarray, layer):
        """`table[layer]`: numpy for a Python int, traced otherwise."""
        return table[layer] if isinstance(layer, int) else jnp.take(jnp.asarray(table), layer)

    def window(self, layer):
        """The window index of `layer` (a Python int for a Python int)."""
        if isinstance(layer, int) or len(self.windows) == 1:
            return int(self.window_index[layer]) if isinstance(layer, int) else 0
        return jnp.take(jnp.asarray(self.window_index), layer)


@functools.lru_cache(maxsize=64)
def layer_settings(config: ModelConfig) -> LayerSettings:
    c = config
    a = c.attention
    # the MTP proposer's layer (models/mtp.py) is number num_layers: full attention, the model's rope
    per_layer = [(a.layer_window(n), a.layer_chunk(n)) for n in range(c.num_layers)] + [(None, None)] * c.run_mtp
    windows = tuple(dict.fromkeys(per_layer))
    global_dim = c.attention.global_head_dim or c.rope_dim  # Gemma 4's full layers: their own head dim
    global_rope = rope_parameters(global_dim, c.attention.rope_theta, c.attention.rope_scaling_dict,
                                  c.max_position_embeddings)
    local_rope = (rope_parameters(c.rope_dim, c.attention.rope_theta, c.attention.rope_scaling_dict,
                                  c.max_position_embeddings) if c.attention.rope_local_theta is None
                  else rope_parameters(c.rope_dim, c.attention.rope_local_theta, None, c.max_position_embeddings))
    widest = max(global_dim, c.rope_dim) // 2
    inv, scale, has, pairs = [], [], [], []
    for n in range(len(per_layer)):
        f, s = local_rope if per_layer[n][0] is not None else global_rope
        nope = n in c.attention.nope_layers
        inv.append(np.pad(np.zeros_like(f) if nope else f, (0, widest - f.shape[0])))
        scale.append(1.0 if nope else s)
        has.append(not nope)
        pairs.append(f.shape[0])
    temperature = [0.0 if a.query_temperature_nope_only and has[n] else a.query_temperature_beta
                   for n in range(len(per_layer))]
    return LayerSettings(windows, np.asarray([windows.index(w) for w in per_layer], np.int32),
                         np.stack(inv).astype(np.float32), np.asarray(scale, np.float32), np.asarray(has),
                         np.asarray(temperature, np.float32), np.asarray(pairs, np.int32))


def by_window(settings: LayerSettings, layer, run):
    """`run(window)` for `layer`'s (sliding window, attention chunk): directly when it is
    known statically, else a lax.switch over the model's distinct windows."""
    index = settings.window(layer)
    if isinstance(index, int):
        return run(settings.windows[index])
    return jax.lax.switch(index, [functools.partial(run, w) for w in settings.windows])
