"""The multi-token-prediction layer of Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints
(`mtp.*`, config.json mtp_num_hidden_layers), loaded only when the engine runs it
(ModelConfig.run_mtp: speculative.method = "mtp", models/mtp.py).

The same block as DeepSeek-V3's under other names (as vLLM's qwen3_next_mtp / qwen3_5_mtp
wire it, read through the `search` tool, not copied):

    mtp.pre_fc_norm_embedding   enorm        (Gemma-style 1 + w, as every Qwen3.5 norm)
    mtp.pre_fc_norm_hidden      hnorm
    mtp.fc                      eh_proj      [E, 2E]: reads [embedding, hidden]
    mtp.layers.0.*              one full-attention decoder layer (gated attention, partial
                                rope, the model's MLP or MoE), named as any layer's
    mtp.norm                    shared_head.norm

The layer is built as the target's layer number num_layers would be: not a linear layer
(ModelConfig.linear.layers stops before it), so gated attention with its own KV cache entry,
and a MoE layer in a MoE model. Embedding and head are the target's: a checkpoint with
`mtp_use_dedicated_embeddings` (its own `mtp.embed_tokens`) is refused rather than proposed
from the wrong table. Layers after the first (`mtp.layers.1.`...) are skipped.
"""

from __future__ import annotations

from jaxfill.models.config import ConfigError
from jaxfill.models.families.base import HFTensor, same
from jaxfill.models.families.mtp_tensors import moved

PREFIX = "mtp."


def qwen_mtp_tensors(family, config) -> dict:
    """HF name -> HFTensor for the MTP block, its decoder layer's params under ("mtp", "layer")."""
    c, e = config, config.hidden_size
    table = {name: moved(spec)
             for name, spec in family.layer_tensors(c, PREFIX + "layers.0.", ("layers", c.num_layers)).items()}
    table.update({
        PREFIX + "pre_fc_norm_embedding.weight": same(("mtp", "enorm", "weight"), (e,)),
        PREFIX + "pre_fc_norm_hidden.weight": same(("mtp", "hnorm", "weight"), (e,)),
        PREFIX + "norm.weight": same(("mtp", "norm", "weight"), (e,)),
        # [E, 2E] (out, in) -> [2E, E]; the inputs are [embedding, hidden] (models/mtp.py)
        PREFIX + "fc.weight": HFTensor(("mtp", "eh_proj"), (e, 2 * e), (e, 2 * e), (1, 0)),
    })
    return table


def skipped_qwen_mtp_prefixes(ignored: tuple[str, ...], config, hf: dict) -> tuple[str, ...]:
    """The family's skipped prefixes (`ignored`, which hold "mtp.") with the MTP block's
    first layer kept when the engine runs it; later MTP layers are skipped either way."""
    if not config.run_mtp:
        return ignored
    if hf.get("mtp_use_dedicated_embeddings") or (hf.get("text_config") or {}).get("mtp_use_dedicated_embeddings"):
        raise ConfigError("speculative.method = 'mtp' reads the target's embedding; this checkpoint's MTP layer has "
                          "its own (config.json mtp_use_dedicated_embeddings = true), which is not loaded: use "
                          "speculative.method = ngram, suffix or none")
    later = tuple(f"{PREFIX}layers.{i}." for i in range(1, max(config.mtp_layers, 1)))
    return tuple(p for p in ignored if p != PREFIX) + later
