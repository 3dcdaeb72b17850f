"""The capability table: which features and model kinds combine, in one place.

Every refusal of a feature combination is a row of RULES, read by engine/validation.py
before any weight is read; `jaxfill models`, each family's support list and the README's
matrix are derived from the same rows plus the tests that run each cell
(engine/capabilities/evidence.py). A combination either runs as asked or is refused here:
nothing downgrades silently.

A condition is a capability key (a config setting that is "on": `mesh.tensor` means
mesh.tensor > 1), a model kind (`mla`, `moe`, `linear`, `gated_deltanet`, `mamba2`,
`short_conv`, `kda`, `attention`, `dsa`: DeepSeek sparse attention's indexer,
`mixed_kv`: attention layers of two shapes, Gemma 4's global ones, `shortcut`: LongCat-Flash's
MoE carried to the next layer, `mrope`: Qwen3-VL's (t, h, w) rope, whose steps carry images), `platform=cpu`, or
`serve.role=prefill/decode`, `images=bidirectional` (a request holds Gemma 3 or Gemma 4 images); a
leading `!` negates it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Capability:
    key: str  # the config key (and value) that turns it on: the name every view uses
    on: Callable  # (config) -> bool
    sample: dict  # overrides that turn it on in a small engine (tests/test_capability_cells.py)
    devices: int = 1  # devices a sample run needs


def _mesh(axis: str) -> Capability:
    return Capability(f"mesh.{axis}", lambda c: int(getattr(c.mesh, axis)) > 1, {f"mesh.{axis}": 2}, 2)


CAPABILITIES: dict[str, Capability] = {c.key: c for c in (
    _mesh("tensor"), _mesh("sequence"), _mesh("data"), _mesh("stage"), _mesh("expert"),
    Capability("mesh.num_processes", lambda c: int(c.mesh.num_processes) > 1, {"mesh.num_processes": 2}, 2),
    Capability("engine.scan_layers", lambda c: bool(c.engine.scan_layers), {"engine.scan_layers": True}),
    Capability("model.weight_dtype=int8", lambda c: c.model.weight_dtype == "int8", {"model.weight_dtype": "int8"}),
    Capability("model.weight_dtype=fp8_block", lambda c: c.model.weight_dtype == "fp8_block",
               {"model.weight_dtype": "fp8_block", "model.weight_block_size": [16, 16]}),
    # AWQ / GPTQ / compressed-tensors ints kept packed (models/int_group.py); random init quantizes
    Capability("model.weight_dtype=int_group", lambda c: c.model.weight_dtype == "int_group",
               {"model.weight_dtype": "int_group", "model.weight_group_size": 32}),
    Capability("engine.kv_cache_dtype=int8", lambda c: c.engine.kv_cache_dtype == "int8",
               {"engine.kv_cache_dtype": "int8"}),
    Capability("engine.kv_cache_dtype=float8_e4m3fn", lambda c: c.engine.kv_cache_dtype == "float8_e4m3fn",
               {"engine.kv_cache_dtype": "float8_e4m3fn"}),
    Capability("engine.enable_prefix_caching", lambda c: bool(c.engine.enable_prefix_caching),
               {"engine.enable_prefix_caching": True}),
    Capability("engine.host_kv_cache_gb", lambda c: float(c.engine.host_kv_cache_gb) > 0,
               {"engine.host_kv_cache_gb": 0.01}),
    Capability("engine.disk_kv_cache_dir", lambda c: bool(c.engine.disk_kv_cache_dir),
               {"engine.disk_kv_cache_dir": "{tmp}", "engine.disk_kv_cache_gb": 0.01,
                "engine.host_kv_cache_gb": 0.01}),
    # Engine.embed / score (engine/pooling/): model.pooling, or a reranker's model.score_token_ids
    Capability("model.pooling", lambda c: c.model.pooling.enabled, {"model.pooling": "last"}),
)}
# Settings that are conditions of rules but not columns of the matrix.
SETTINGS: dict[str, Callable] = {
    "engine.attention_impl=pallas": lambda c: c.engine.attention_impl in ("pallas_tpu", "pallas_gpu", "mosaic_gpu"),
    "model.context_attention=pass_kv": lambda c: c.model.attention.context_attention == "pass_kv",
    "engine.kv_cache_dtype=quantized": lambda c: c.engine.kv_cache_dtype != "auto",
    "model.dtype=bfloat16": lambda c: str(c.model.dtype) == "bfloat16",
    "model.weight_act_order=true": lambda c: bool(c.model.weight_act_order),
    "model.weight_int_scope=experts": lambda c: c.model.weight_int_scope == "experts",
    "speculative.method=ngram/suffix/mtp": lambda c: c.speculative.enabled,
    "lora.max_loras": lambda c: c.lora.enabled,
    "speculative.method=mtp": lambda c: c.speculative.method == "mtp",
}
KINDS = ("attention", "mla", "gated_deltanet", "mamba2", "short_conv", "kda", "linear", "moe", "dsa", "mixed_kv", "shortcut",
         "mrope")
LINEAR_KINDS = ("gated_deltanet", "mamba2", "short_conv", "kda")  # each is also "linear"
# the flag a request with Gemma 3 or Gemma 4 images adds (engine/vision/loading.py): checked per
# request. Gemma 4's image rows are causal unless its text config asks for both ways; its
# images take the same rows either way (their steps carry image rows on the unrolled layout)
IMAGES_BIDIRECTIONAL = "images=bidirectional"


def model_kinds(model) -> frozenset[str]:
    """The mixers and MLPs a ModelConfig holds (what the rules' kind conditions test)."""
    kinds = set()
    if model.linear.layers:
        kinds |= {"linear", model.linear.kind}
    if any(model.attends(n) for n in range(model.num_layers)):  # Falcon-H1's parallel layers attend too
        kinds.add("mla" if model.mla.kv_lora_rank else "attention")
    if model.moe.num_experts:
        kinds.add("moe")
    if model.mla.index_topk:
        kinds.add("dsa")
    if model.mixed_kv:
        kinds.add("mixed_kv")
    if model.moe.shortcut:
        kinds.add("shortcut")
    if model.attention.mrope_section:
        kinds.add("mrope")
    return frozenset(kinds)


def family_kinds(family) -> frozenset[str]:
    """What a family's models hold, from its declared mixers (models/families/base.py)."""
    kinds = set(family.mixers) | ({"moe"} if family.experts else set()) | ({"dsa"} if family.indexer else set())
    kinds |= {"mixed_kv"} if family.mixed_kv else set()
    kinds |= {"shortcut"} if family.shortcut else set()
    kinds |= {"mrope"} if family.multimodal_rope else set()
    return frozenset(kinds | ({"linear"} if kinds & set(LINEAR_KINDS) else set()))


@dataclasses.dataclass(frozen=True)
class Rule:
    when: tuple[str, ...]  # every condition holds -> refused
    why: str
    change: str  # the key to change, as the one-line refusal says it

    def columns(self) -> tuple[str, ...]:
        """The matrix columns this rule refuses for a family whose kinds make the rest hold."""
        return tuple(c for c in self.when if c in CAPABILITIES)


_HYBRID = "linear-attention state is per request, one slot pool per data replica"
RULES: tuple[Rule, ...] = (
    # hybrids (Gated DeltaNet, Mamba2, LFM2's short convolution): their state splits by heads over
    # tensor, by slot pool over data (one per replica), and is replicated over expert ranks; not yet:
    *(Rule(("linear", key), f"{_HYBRID}: {why}", f"{key} (hybrids run on mesh.tensor, mesh.data, mesh.expert)")
      for key, why in (
        ("mesh.sequence", "no context-parallel form of the recurrent scan"),
        ("mesh.num_processes", "state slots are not kept in lockstep across processes"),
    )),
    # the hand-off's import offsets the slot to its replica's rows (untested under mesh.data)
    Rule(("linear", "mesh.data", "serve.role=prefill/decode"), f"{_HYBRID}: the state hand-off is not tested "
         "across data replicas", "mesh.data = 1 or --role both"),
    # the disk tier keeps state snapshots beside the pages (engine/kv_tier/disk_format.py):
    # tested on Gated DeltaNet and Mamba2 (tests/test_hybrid_disk_tier.py), not yet on these
    *(Rule((kind, "engine.disk_kv_cache_dir"), f"state snapshots on disk are not tested with {kind} layers",
           "engine.disk_kv_cache_dir = \"\"") for kind in ("short_conv", "kda")),
    # Gemma 4: global layers with their own head dim / KV heads / V = K beside the sliding ones
    *(Rule(("mixed_kv", key), f"attention layers of two shapes: {why}", change) for key, why, change in (
        ("engine.scan_layers", "they cannot stack as one scan", "engine.scan_layers = false"),
        ("mesh.stage", "they cannot stack into pipeline stages", "mesh.stage = 1"),
        # (the disk tier sits below the host tier: refused with it)
        ("engine.host_kv_cache_gb", "the host tier's blocks hold one page shape", "engine.host_kv_cache_gb = 0"),
        ("serve.role=prefill/decode", "the KV hand-off exports one page shape", "--role both"),
    )),
    # packed int codes (models/int_group.py): dense attention and MLP projections only
    Rule(("linear", "model.weight_dtype=int_group"), "the linear layers' projections have no packed int path",
         "model.weight_dtype = auto (the checkpoint's codes dequantized at load)"),
    Rule(("mla", "model.weight_dtype=int_group", "!model.weight_int_scope=experts"), "the latent projections have "
         "no packed int path (a checkpoint that packs the routed experts alone loads)",
         "model.weight_dtype = auto (the checkpoint's codes dequantized at load)"),
    Rule(("!moe", "model.weight_dtype=int_group", "model.weight_int_scope=experts"), "there are no routed experts "
         "to keep packed", "model.weight_int_scope = all"),
    Rule(("moe", "model.weight_dtype=int_group", "model.weight_act_order=true"), "stacked expert tensors have no "
         "act-order (g_idx) form", "model.weight_dtype = auto (the checkpoint's codes dequantized at load)"),
    Rule(("mesh.expert", "!moe"), "mesh.expert splits experts, and this model has none", "mesh.expert = 1"),
    Rule(("dsa", "mesh.sequence"), "the sparse-attention indexer scores every cached key of a sequence, which "
         "context parallelism deals over ranks", "mesh.sequence = 1"),
    # LongCat-Flash: its layers alternate (a MoE in every other one) and hand a shortcut on
    Rule(("shortcut", "mesh.stage"), "the shortcut MoE's stream is not handed between pipeline stages",
         "mesh.stage = 1"),
    Rule(("shortcut", "engine.scan_layers"), "layers with and without the shortcut MoE differ, so they cannot "
         "stack as one scan", "engine.scan_layers = false"),
    # layouts
    Rule(("mesh.stage", "mesh.sequence"), "pipeline stages compose with mesh.tensor and mesh.data, not sequence",
         "mesh.stage = 1 or mesh.sequence = 1"),
    Rule(("engine.scan_layers", "mesh.stage"), "scan_layers stacks all layers on every device, stages split "
         "them: choose one", "engine.scan_layers = false or mesh.stage = 1"),
    Rule(("engine.attention_impl=pallas", "mesh.sequence"), "the Pallas kernels do not take a rank's share of "
         "the pages", "engine.attention_impl = auto (xla under mesh.sequence)"),
    Rule(("model.context_attention=pass_kv", "engine.kv_cache_dtype=quantized"), "the pass-KV ring rotates "
         "unquantized K/V only", "model.context_attention = auto"),
    Rule(("model.context_attention=pass_kv", "mla"), "the pass-KV ring has no latent form",
         "model.context_attention = auto"),
    Rule(("platform=cpu", "model.dtype=bfloat16", "mesh.tensor"), "XLA:CPU aborts compiling bf16 all-reduces "
         "(jax 0.10.2 and 0.11.2)", "model.dtype = float32 or mesh.tensor = 1"),
    # KV tiers
    Rule(("engine.host_kv_cache_gb", "!engine.enable_prefix_caching"), "the host tier keeps prefix-cache pages",
         "engine.enable_prefix_caching = true"),
    Rule(("engine.disk_kv_cache_dir", "!engine.host_kv_cache_gb"), "the disk tier sits below the host tier",
         "engine.host_kv_cache_gb > 0"),
    Rule(("engine.disk_kv_cache_dir", "mesh.num_processes"), "each process would write its own files",
         "engine.disk_kv_cache_dir = \"\""),
    # disaggregation (serve --role prefill | decode): mesh.data and mesh.num_processes work on
    # either side (tests/test_kv_transfer_data.py, tests/test_disagg_multihost.py); its refusals
    # sit with the features they concern (mixed_kv above, speculative and LoRA below)
    # pooling (engine/pooling/): Engine.embed / score rows in one replica's unstacked or scanned step
    *(Rule(("model.pooling", cond), f"pooling: {why}", f"model.pooling = none (and no model.score_token_ids) or "
           f"{change}") for cond, why, change in (
        ("mesh.data", "pooled rows are laid out for one data replica", "mesh.data = 1"),
        ("mesh.stage", "pooled rows through pipeline stages are not tested", "mesh.stage = 1"),
        ("mesh.num_processes", "followers' replay of pooling steps is not built", "mesh.num_processes = 1"),
        ("speculative.method=ngram/suffix/mtp", "verification beside pooled rows is not tested", "speculative.method = none"),
    )),
    # speculative decoding (engine/speculative/): proposals verified as rows of one replica's ragged step
    *(Rule((cond, "speculative.method=ngram/suffix/mtp"), f"speculative decoding: {why}", change) for cond, why, change in (
        # hybrids: the state before a verification is kept and the accepted rows replayed
        # (engine/scheduler/verification.py); tests/test_hybrid_spec.py runs Gated DeltaNet, Mamba2
        # (Granite 4.0-H, Falcon-H1's parallel layers), LFM2's short convolution and Kimi Delta Attention
        ("mesh.data", "verification rows are laid out for one data replica", "speculative.method = none or "
         "mesh.data = 1"),
        ("mesh.stage", "pipeline microbatches do not carry verification rows", "speculative.method = none or "
         "mesh.stage = 1"),
        ("mesh.sequence", "verification under context parallelism is not tested", "speculative.method = none or "
         "mesh.sequence = 1"),
        ("mesh.num_processes", "followers' replay of verification steps is not tested",
         "speculative.method = none or mesh.num_processes = 1"),
        ("serve.role=prefill/decode", "the KV hand-off is not tested with verification steps",
         "speculative.method = none or --role both"),
    )),
    # the MTP proposer (models/mtp.py, engine/speculative/mtp_step.py): one more cache entry, one more
    # decoder layer in every step program; what it is not tested beside yet
    *(Rule(("speculative.method=mtp", cond), f"speculative decoding with mtp: {why}",
           f"speculative.method = ngram, suffix or none, or {change}") for cond, why, change in (
        ("engine.scan_layers", "stacked layers have no MTP cache entry", "engine.scan_layers = false"),
        ("mesh.expert", "the MTP layer's experts split over expert ranks are not tested", "mesh.expert = 1"),
        ("engine.host_kv_cache_gb", "the host tier's copies of the MTP layer's pages are not tested",
         "engine.host_kv_cache_gb = 0"),
        ("engine.kv_cache_dtype=quantized", "a quantized MTP cache entry is not tested", "engine.kv_cache_dtype = auto"),
        ("model.weight_dtype=int8", "the MTP layer's projections stay unquantized", "model.weight_dtype = auto"),
        ("model.weight_dtype=fp8_block", "the MTP layer's fp8 projections are not read", "model.weight_dtype = auto"),
        ("model.weight_dtype=int_group", "the MTP layer's packed projections are not read",
         "model.weight_dtype = auto"),
        ("dsa", "the MTP layer of a sparse-attention model (its indexer) is not built", "a model without dsa"),
    )),
    # multi-LoRA (engine/lora/, models/lora.py): per-row adapters on the unrolled layers' attention
    # q/k/v/o, gated-MLP and routed-expert projections of one replica; Llama, Qwen3 and Qwen3-MoE
    # (engine/lora/settings.py)
    *(Rule(("lora.max_loras", cond), f"LoRA: {why}", f"lora.max_loras = 0 or {change}") for cond, why, change in (
        ("mla", "latent attention's projections have no adapter tables", "a model with plain attention"),
        ("mesh.expert", "the experts' adapter tables are not split over expert ranks", "mesh.expert = 1"),
        ("linear", "the linear mixers' projections have no adapter tables", "a model with attention layers only"),
        ("mixed_kv", "attention layers of two shapes are not mapped", "a model with one attention shape"),
        ("mesh.data", "slot ids are laid out for one data replica", "mesh.data = 1"),
        ("mesh.sequence", "rows split over sequence ranks are not tested", "mesh.sequence = 1"),
        ("mesh.stage", "stacked layer groups have no adapter tables", "mesh.stage = 1"),
        ("engine.scan_layers", "stacked layers have no adapter tables", "engine.scan_layers = false"),
        ("mesh.num_processes", "adapter loads are not broadcast to followers", "mesh.num_processes = 1"),
        ("model.weight_dtype=int8", "beside int8 weights it is not tested", "model.weight_dtype = auto"),
        ("model.weight_dtype=fp8_block", "beside fp8 weights it is not tested", "model.weight_dtype = auto"),
        ("model.weight_dtype=int_group", "beside packed int weights it is not tested", "model.weight_dtype = auto"),
        ("speculative.method=ngram/suffix/mtp", "verification rows with adapters are not tested", "speculative.method = none"),
        ("serve.role=prefill/decode", "the KV hand-off does not carry the adapter", "--role both"),
    )),
    Rule(("lora.max_loras", "moe", "mesh.tensor"), "LoRA: the experts' adapter tables split over tensor are not "
         "tested", "lora.max_loras = 0 or mesh.tensor = 1"),
    # images (engine/vision/, docs/vision.md): Qwen3-VL's (t, h, w) positions and image rows ride
    # one replica's unrolled step beside its tokens; model.mrope_section = [] loads the text tower alone
    *(Rule(("mrope", cond), f"images and (t, h, w) rope: {why}",
           f"{change}, or model.mrope_section = [] (the text tower alone, no images)") for cond, why, change in (
        ("mesh.data", "image rows are laid out for one data replica", "mesh.data = 1"),
        ("mesh.sequence", "image rows split over sequence ranks are not built", "mesh.sequence = 1"),
        ("mesh.stage", "pipeline microbatches do not carry image rows or DeepStack's adds", "mesh.stage = 1"),
        ("mesh.num_processes", "followers' replay of image rows is not built", "mesh.num_processes = 1"),
        ("engine.scan_layers", "DeepStack adds after chosen layers, which a scan does not single out",
         "engine.scan_layers = false"),
        ("speculative.method=ngram/suffix/mtp", "verification rows have no (t, h, w) positions",
         "speculative.method = none"),
        ("lora.max_loras", "adapters on this family are not built", "lora.max_loras = 0"),
        ("model.pooling", "pooled rows with images are not tested", "model.pooling = none"),
        ("engine.host_kv_cache_gb", "the host tier with image pages is not tested", "engine.host_kv_cache_gb = 0"),
        ("serve.role=prefill/decode", "the KV hand-off does not carry the prompt's positions or images",
         "--role both"),
    )),
    # Gemma 3's and Gemma 4's images (engine/vision/gemma3_tower.py, gemma4_tower.py): their rows
    # attend each other both ways (the attention's key_limits; Gemma 4 on sliding layers, when
    # its config asks). A flag, not a kind: the engine builds and serves text as for any
    # Gemma; a request with images is refused by the rule (InvalidRequest)
    *(Rule((IMAGES_BIDIRECTIONAL, cond), f"Gemma 3 images (and Gemma 4's): {why}", change) for cond, why, change in (
        ("mesh.data", "image rows are laid out for one data replica", "mesh.data = 1"),
        ("mesh.sequence", "the context-parallel kernels take no image mask", "mesh.sequence = 1"),
        ("mesh.stage", "pipeline microbatches do not carry image rows", "mesh.stage = 1"),
        ("mesh.num_processes", "followers' replay of image rows is not built", "mesh.num_processes = 1"),
        ("engine.scan_layers", "the scanned layout does not take image rows", "engine.scan_layers = false"),
        ("speculative.method=ngram/suffix/mtp", "verification rows beside image rows are not tested",
         "speculative.method = none"),
        ("lora.max_loras", "adapters beside image rows are not tested", "lora.max_loras = 0"),
        ("model.pooling", "pooled rows with images are not tested", "model.pooling = none"),
        ("engine.host_kv_cache_gb", "the host tier with image pages is not tested", "engine.host_kv_cache_gb = 0"),
    )),
)


def condition_holds(cond: str, config, kinds: frozenset, extra: frozenset) -> bool | None:
    """Whether `cond` holds for this config (None: it is a kind or flag not decided here)."""
    neg = cond.startswith("!")
    name = cond[1:] if neg else cond
    if name in CAPABILITIES:
        value = CAPABILITIES[name].on(config)
    elif name in SETTINGS:
        value = SETTINGS[name](config)
    elif name in KINDS:
        value = name in kinds
    else:
        value = name in extra
    return value != neg


def refusals(config, kinds: frozenset, extra: frozenset = frozenset()) -> list[Rule]:
    """The rules this config breaks (extra: flags like platform=cpu, serve.role=decode)."""
    return [r for r in RULES if all(condition_holds(c, config, kinds, extra) for c in r.when)]


def refused_columns(kinds: frozenset) -> dict[str, Rule]:
    """column -> the rule that refuses it for every model of these kinds alone (rules whose
    other conditions are kinds only)."""
    out: dict[str, Rule] = {}
    for rule in RULES:
        rest = [c for c in rule.when if c not in CAPABILITIES]
        cols = rule.columns()
        if len(cols) != 1 or not all(c.lstrip("!") in KINDS for c in rest):
            continue
        if all((c[1:] not in kinds) if c.startswith("!") else (c in kinds) for c in rest):
            out.setdefault(cols[0], rule)
    return out
