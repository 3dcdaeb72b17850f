"""The multi-token-prediction layer's tensors (DeepSeek-V3 / GLM-4.5 layout), loaded only
when the engine runs it (ModelConfig.run_mtp: speculative.method = "mtp", models/mtp.py).

The checkpoint puts it after the last decoder layer, at `model.layers.{num_layers}.`: the
decoder layer's own tensors (named as any layer's) beside enorm, hnorm, eh_proj and
shared_head.norm. Its `embed_tokens` and `shared_head.head` are copies of the target's
(the layer uses the target's, models/mtp.py) and are skipped; a checkpoint without them
loads the same.
"""

from __future__ import annotations

from jaxfill.models.families.base import HFTensor, same

SHARED_COPIES = ("embed_tokens.", "shared_head.head.")  # under the MTP layer's prefix: never loaded


def mtp_prefix(config) -> str:
    return f"model.layers.{config.num_layers}."


def mtp_tensors(family, config) -> dict:
    """HF name -> HFTensor for the MTP layer, its decoder layer's params under ("mtp", "layer")."""
    c, p, e = config, mtp_prefix(config), config.hidden_size
    table = {}
    for name, spec in family.layer_tensors(c, p, ("layers", c.num_layers)).items():
        table[name] = moved(spec)
    table.update({
        p + "enorm.weight": same(("mtp", "enorm", "weight"), (e,)),
        p + "hnorm.weight": same(("mtp", "hnorm", "weight"), (e,)),
        p + "shared_head.norm.weight": same(("mtp", "norm", "weight"), (e,)),
        # [E, 2E] (out, in) -> [2E, E]; the inputs are [embedding, hidden] (models/mtp.py)
        p + "eh_proj.weight": HFTensor(("mtp", "eh_proj"), (e, 2 * e), (e, 2 * e), (1, 0)),
    })
    return table


def skipped_mtp_prefixes(config, layers: int) -> tuple[str, ...]:
    """The MTP layers' name prefixes the loader skips: all of them when the engine does not
    run the layer, else the copies of the embedding and head, and any layer after the first."""
    first = config.num_layers
    later = tuple(f"model.layers.{first + i}." for i in range(1, layers))
    if not config.run_mtp:
        return (f"model.layers.{first}.",) + later if layers else ()
    return tuple(mtp_prefix(config) + s for s in SHARED_COPIES) + later


def moved(spec):
    """A layer's HFTensor (or fused parts) re-rooted from ("layers", L, ...) to ("mtp", "layer", ...)."""
    if isinstance(spec, HFTensor):
        return spec._replace(param_path=("mtp", "layer") + tuple(spec.param_path[2:]))
    return tuple(moved(s) for s in spec)
