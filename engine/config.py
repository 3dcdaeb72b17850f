"""Reads a TOML preset ([model] [engine] [mesh]) plus `section.key=value` overrides.

The same override keys work on the CLI (`--set mesh.tensor=4`) and in notebooks
(`Engine.from_config("tiny", overrides={"mesh.tensor": 4})`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tomllib
from typing import Any, Mapping

from jaxfill.engine.lora.settings import LoraSettings
from jaxfill.engine.checkpoint_settings import checkpoint_engine, checkpoint_name, describe
from jaxfill.engine.speculative.mtp_settings import mtp_model
from jaxfill.engine.presets import NOT_PRESETS, preset_names, read_preset  # noqa: F401 (their old home)
from jaxfill.models.config import ConfigError, ModelConfig, flat_keys, int_quantization, quantization, read_config_json
from jaxfill.engine.validation import validate
from jaxfill.models.embedding_checkpoint import has_lm_head, sentence_transformers_fields
from jaxfill.models.families.registry import config_from_dict, config_from_hf
from jaxfill.models.gguf import gguf_file, hf_config_of

log = logging.getLogger("jaxfill.config")

KV_CACHE_DTYPES = ("auto", "int8", "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    page_size: int = 16
    # per data replica, including the reserved null page 0; 0: as many as fit in
    # memory_utilization of the device's memory after weights and activations (engine/memory.py)
    num_pages: int = 1024
    memory_utilization: float = 0.9  # share of the allocator's limit (CPU: of RAM) num_pages = 0 may fill
    # CPU, num_pages = 0: at most this many GiB of pool per process (0: no cap). The host's RAM
    # is everyone's: 0.9 of it gave SmolLM2-135M a 14.5 GB RSS for one 16-token answer.
    # vLLM's CPU backend reserves 4 GiB by default (VLLM_CPU_KVCACHE_SPACE).
    cpu_kv_cache_gb: float = 4.0
    max_model_len: int = 4096
    max_num_seqs: int = 16  # sequences per step
    max_num_batched_tokens: int = 256  # token budget per step
    attention_impl: str = "auto"
    enable_prefix_caching: bool = True
    max_num_partial_prefills: int = 1  # prompts allowed mid-prefill at once
    long_prefill_token_threshold: int = 0  # 0: no cap on one prompt's chunk
    max_waiting: int = 1024  # bounded waiting queue (serving backpressure)
    token_buckets: tuple[int, ...] = ()  # () -> derived from max_num_batched_tokens
    seq_buckets: tuple[int, ...] = ()  # () -> derived from max_num_seqs
    # Token buckets for decode-sized steps, added below the derived 16, 64, 256, ... (not to an
    # explicit token_buckets, which is the whole list): a lone decode then runs 1 row, not 16,
    # and with S <= T its sampler and LM head S rows too. Each is one more compiled program;
    # checkpoint runs (engine/checkpoint_settings.py) set them, presets leave them empty.
    decode_buckets: tuple[int, ...] = ()
    seed: int = 0
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (lower priority value runs first)
    penalty_window: int = 256  # tokens of history the repetition/presence/frequency penalties see
    # prompt rows a step scores for prompt_logprobs requests (their logits: rows x vocab x 4 bytes)
    prompt_logprobs_rows: int = 256
    chunked_prefill: bool = True  # False: baseline, whole prompts in prefill-only steps, decodes wait
    # "auto": pages in the model's dtype; "int8" / "float8_e4m3fn": quantized pages with one
    # f32 scale per (token, K or V head) beside them (pallas_kernels/kv_quant.py)
    kv_cache_dtype: str = "auto"
    # True: step N+1 is dispatched before step N's tokens reach the host; decodes take their
    # input token on the device (engine/async_step.py). False: the synchronous baseline.
    async_scheduling: bool = True
    # True: the layers run as one lax.scan over stacked params and a stacked cache, so a
    # bucket compiles in about the same time for 4 or 80 layers (models/parallel/pipeline.py).
    scan_layers: bool = False
    # Disaggregated prefill (engine/disagg/transfer.py): how long a prefill worker holds a finished
    # prompt's pages for the decode worker's pull, and how long a decode worker waits for it.
    kv_transfer_timeout_s: float = 30.0
    # The share of the page pool a prefill worker may hold for pulls not yet made; past it
    # a new prefill-for-transfer request is refused (RESOURCE_EXHAUSTED), so clients whose
    # decode leg never pulls cannot fill the pool.
    kv_transfer_max_held_share: float = 0.5
    # What fresh KV pages hold before anything writes them (a new or rebuilt cache). Tests
    # set nan: a step that reads a page nobody wrote then poisons its logits.
    kv_fill_value: float = 0.0
    # The prefix cache's host tier (engine/kv_tier/host.py): GB of host RAM that keep full
    # pages evicted from the device pool, restored instead of recomputed; 0 = off. Below it
    # a disk tier (engine/kv_tier/disk.py): a directory and its budget in GB.
    host_kv_cache_gb: float = 0.0
    disk_kv_cache_dir: str = ""
    disk_kv_cache_gb: float = 0.0
    # Linear-attention hybrids (models/mixers/gated_deltanet.py): recurrent-state slots, one per
    # running request (the scheduler hands them out). Set by load_config for such models
    # (= max_num_seqs, twice that with speculative decoding); 0 for every other model.
    state_slots: int = 0
    # Their prefix caching (engine/scheduler/state_snapshots.py): the recurrent state is
    # snapshotted every state_snapshot_tokens tokens (a multiple of page_size; 0 = no
    # prefix caching for hybrids) into state_snapshot_slots slots (0 = max_num_seqs).
    # One snapshot of Qwen3.5-9B's 24 linear layers holds 48 MiB: the KV of ~1.5k tokens.
    state_snapshot_tokens: int = 512
    state_snapshot_slots: int = 0

    @property
    def state_pool_slots(self) -> int:
        """Slots of each linear layer's state array: working, snapshots, and one null slot
        last (the target of padded copies)."""
        return self.state_slots + self.state_snapshot_slots + 1

    def __post_init__(self):
        for name in ("page_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"engine.{name} must be positive, got {getattr(self, name)}")
        if self.num_pages != 0 and self.num_pages < 2:
            raise ConfigError("engine.num_pages must be at least 2 (page 0 is the null page), "
                              f"or 0 to size the pool from memory; got {self.num_pages}")
        if not float(self.cpu_kv_cache_gb) >= 0:
            raise ConfigError(f"engine.cpu_kv_cache_gb must be >= 0 (0: no cap), got {self.cpu_kv_cache_gb}")
        if not 0 < float(self.memory_utilization) <= 1:
            raise ConfigError(f"engine.memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"engine.scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if int(self.prompt_logprobs_rows) <= 0:
            raise ConfigError(f"engine.prompt_logprobs_rows must be positive, got {self.prompt_logprobs_rows}")
        if int(self.penalty_window) <= 0:
            raise ConfigError(f"engine.penalty_window must be positive, got {self.penalty_window}")
        if not 0 < float(self.kv_transfer_max_held_share) <= 1:
            raise ConfigError(f"engine.kv_transfer_max_held_share must be in (0, 1], "
                              f"got {self.kv_transfer_max_held_share}")
        if not float(self.kv_transfer_timeout_s) > 0:
            raise ConfigError(f"engine.kv_transfer_timeout_s must be positive, got {self.kv_transfer_timeout_s}")
        for name in ("host_kv_cache_gb", "disk_kv_cache_gb"):
            if not float(getattr(self, name)) >= 0:
                raise ConfigError(f"engine.{name} must be >= 0 (0 = off), got {getattr(self, name)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"engine.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    data: int = 1
    tensor: int = 1
    sequence: int = 1
    stage: int = 1  # pipeline stages: layers split into this many contiguous groups
    # MoE experts split over this many ranks; attention and dense MLPs split over
    # tensor x expert (models/sharding.py)
    expert: int = 1
    microbatches: int = 4  # per step and stage group, when stage > 1 (see ARCHITECTURE.md)
    coordinator: str = ""  # "host:port" for multi-process runs; "" = single process
    num_processes: int = 1
    process_id: int = 0
    # With every axis above at 1 on a single-process CPU host: split the heads over the
    # XLA CPU devices (one per core by default) as mesh.tensor = t (engine/cpu_devices.py).
    cpu_split: bool = True

    def __post_init__(self):
        for name in ("data", "tensor", "expert", "sequence", "stage", "microbatches", "num_processes"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"mesh.{name} must be positive, got {getattr(self, name)}")

    @property
    def size(self) -> int:
        return self.stage * self.data * self.tensor * self.expert * self.sequence

    @property
    def heads(self) -> int:
        """Ranks the attention heads, dense MLP columns and vocab split over: tensor x expert."""
        return self.tensor * self.expert


SPEC_METHODS = ("none", "ngram", "suffix", "mtp")  # built; DESIGN.md names eagle3 for a later slice
SPEC_LATER = ("eagle3",)


@dataclasses.dataclass(frozen=True)
class SpeculativeSettings:
    """Speculative decoding (engine/speculative/): each decode proposes up to num_tokens
    tokens and verifies them as a short chunk in the same ragged step. ngram: prompt
    lookup, the tokens that followed the most recent earlier occurrence of the last n
    tokens (n from ngram_max down to ngram_min). suffix: suffix decoding
    (engine/speculative/suffix.py), the most frequent continuation of the newest tokens in
    the request and in recent requests' outputs, as long as it is likely enough. mtp: the
    checkpoint's multi-token-prediction layer (DeepSeek-V3, GLM-4.5, Qwen3.5; models/mtp.py) guesses
    the token after the next, one proposal per decode (engine/speculative/mtp_step.py)."""

    method: str = "none"  # "none" | "ngram" | "suffix" | "mtp"
    num_tokens: int = 4  # proposals per decode and step (k)
    ngram_max: int = 4
    ngram_min: int = 2
    # suffix: the newest suffix_max_depth tokens are matched; a match of m tokens proposes at most
    # suffix_spec_factor x m, while the estimated chance that all are accepted >= suffix_min_token_prob;
    # the global cache of finished requests' outputs holds suffix_cache_tokens tokens (oldest evicted)
    suffix_max_depth: int = 24
    suffix_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    suffix_cache_tokens: int = 65536
    # when proposing does not pay (engine/speculative/policy.py): no proposals in a step whose
    # running decode count reaches disable_by_batch_size (0 = never; vLLM's name; default measured
    # in benchmarks/RESULTS.md); a request whose last backoff_window verifications accepted under
    # backoff_min_acceptance of their proposals stops proposing for backoff_steps of its decode
    # steps, doubling up to backoff_max_steps (backoff_window = 0: never)
    disable_by_batch_size: int = 8
    backoff_window: int = 4
    backoff_min_acceptance: float = 0.25
    backoff_steps: int = 8
    backoff_max_steps: int = 128

    def __post_init__(self):
        if self.method in SPEC_LATER:
            raise ConfigError(f"speculative.method = {self.method!r} is not built yet; use 'ngram', 'suffix', 'mtp' "
                              "or 'none'")
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative.method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        if int(self.num_tokens) <= 0:
            raise ConfigError(f"speculative.num_tokens must be positive, got {self.num_tokens}")
        if not 1 <= int(self.ngram_min) <= int(self.ngram_max):
            raise ConfigError(f"speculative.ngram_min must be in [1, speculative.ngram_max]; "
                              f"got {self.ngram_min}, {self.ngram_max}")
        if isinstance(self.suffix_max_depth, bool) or not isinstance(self.suffix_max_depth, int) \
                or self.suffix_max_depth < 1:
            raise ConfigError(f"speculative.suffix_max_depth must be an integer >= 1, got {self.suffix_max_depth!r}")
        for key in ("suffix_spec_factor", "suffix_min_token_prob"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or (key == "suffix_min_token_prob" and value > 1):
                raise ConfigError(f"speculative.{key} must be a number > 0{' and <= 1' if 'prob' in key else ''}, "
                                  f"got {value!r}")
        for key in ("disable_by_batch_size", "backoff_window", "backoff_steps", "backoff_max_steps",
                    "suffix_cache_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"speculative.{key} must be an integer >= 0, got {value!r}")
        if self.disable_by_batch_size == 1:
            raise ConfigError("speculative.disable_by_batch_size = 1 would never propose (every step with a decode "
                              "reaches it): use speculative.method = none, 0 (never disable) or >= 2")
        if isinstance(self.backoff_min_acceptance, bool) or not isinstance(self.backoff_min_acceptance, (int, float)) \
                or not 0.0 <= self.backoff_min_acceptance <= 1.0:
            raise ConfigError(f"speculative.backoff_min_acceptance must be a fraction in [0, 1] of the proposals "
                              f"accepted, got {self.backoff_min_acceptance!r}")
        if self.backoff_window and not 1 <= self.backoff_steps <= self.backoff_max_steps:
            raise ConfigError(f"speculative.backoff_steps must be in [1, speculative.backoff_max_steps] while "
                              f"speculative.backoff_window > 0; got {self.backoff_steps}, {self.backoff_max_steps}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    model: ModelConfig
    engine: EngineSettings
    mesh: MeshSettings
    model_path: str | None = None
    speculative: SpeculativeSettings = SpeculativeSettings()
    lora: LoraSettings = LoraSettings()  # multi-LoRA slots (engine/lora/)


SECTIONS = {"model": ModelConfig, "engine": EngineSettings, "mesh": MeshSettings, "speculative": SpeculativeSettings,
            "lora": LoraSettings}


def parse_overrides(overrides: Mapping[str, Any] | list[str] | None) -> dict[str, dict[str, Any]]:
    """{"mesh.tensor": 4} or ["mesh.tensor=4"] -> {"mesh": {"tensor": 4}}."""
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        pairs = {}
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like section.key=value")
            key, raw = item.split("=", 1)
            pairs[key.strip()] = _parse_value(raw.strip())
        overrides = pairs
    out: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        if section not in SECTIONS or not field:
            raise ConfigError(f"override key {key!r} must be one of model.*, engine.*, mesh.*, speculative.*, lora.*")
        known = flat_keys() if section == "model" else {f.name for f in dataclasses.fields(SECTIONS[section])}
        if field not in known:
            raise ConfigError(f"unknown key {key!r}; {section} has: {', '.join(sorted(known))}")
        out.setdefault(section, {})[field] = value
    return out


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # bare strings: --set engine.attention_impl=xla


def _build(cls, values: dict[str, Any]):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"unknown keys for {cls.__name__}: {sorted(unknown)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    for f in dataclasses.fields(cls):  # "False" left as a string would count as true
        if f.name in values and f.type in ("bool", bool) and not isinstance(values[f.name], bool):
            raise ConfigError(f"{cls.__name__}.{f.name} must be true or false, got {values[f.name]!r}")
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"bad {cls.__name__} values: {e}") from None


def load_config(config: str | None = None, overrides: Mapping[str, Any] | list[str] | None = None,
                model_path: str | None = None) -> Config:
    """A preset or TOML file, then overrides. `model_path` (`--model DIR`) brings its own
    config.json; otherwise a preset's top-level `checkpoint = "DIR"` (relative to the TOML)
    supplies weights for the shapes its [model] section describes. `config=None`: with a
    `model_path`, the engine settings and name come from the checkpoint
    (engine/checkpoint_settings.py); without one, the "tiny" preset."""
    from_checkpoint = config is None and bool(model_path)
    name, data, base = (checkpoint_name(model_path), {}, None) if from_checkpoint else read_preset(config or "tiny")
    checkpoint = data.pop("checkpoint", None)
    unknown = set(data) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"{config}: unknown sections {sorted(unknown)}; expected [model] [engine] [mesh] "
                          "[speculative] [lora] and an optional checkpoint = \"DIR\"")
    extra = parse_overrides(overrides)
    if model_path:
        model = config_from_hf(model_path)
        if not gguf_file(model_path):  # sentence-transformers modules, an embedding backbone's missing head
            model = model.replace(**sentence_transformers_fields(model_path), has_lm_head=model.embeddings.head
                                  and has_lm_head(model_path, model.embeddings.tied))
        model_extra = extra.get("model", {})
        model = model.replace(**model_extra) if model_extra else model
        if model.weight_dtype == "fp8_block" and not quantization.is_fp8(read_config_json(model_path)):
            raise ConfigError(f"model.weight_dtype = 'fp8_block' keeps an fp8 checkpoint's projections as stored, "
                              f"and {model_path} is not one (no quantization_config quant_method fp8): use auto "
                              "or int8")
        if from_checkpoint:
            data["engine"] = checkpoint_engine(model)
            describe(name, model, {**data["engine"], **extra.get("engine", {})})
    else:
        model = config_from_dict({**data.get("model", {}), **extra.get("model", {})})
        model_path = os.path.join(base, checkpoint) if checkpoint else None
    gguf = gguf_file(model_path)
    if gguf:  # its projections' types decide whether int_group can keep them (models/gguf/int_codes.py)
        int_quantization.check_checkpoint(model, hf_config_of(gguf), model_path)
    elif model_path and os.path.exists(os.path.join(model_path, "config.json")):
        int_quantization.check_checkpoint(model, read_config_json(model_path), model_path)
    elif model.weight_dtype == "int_group" and model_path:
        raise ConfigError(f"model.weight_dtype = 'int_group' keeps an AWQ / GPTQ / compressed-tensors checkpoint's "
                          f"codes as stored, and {model_path} has no config.json naming one: use auto or int8")
    engine_values = {**data.get("engine", {}), **extra.get("engine", {})}
    engine_values = _fit_max_model_len(engine_values, "max_model_len" in extra.get("engine", {}), model)
    engine = _build(EngineSettings, engine_values)
    mesh = _build(MeshSettings, {**data.get("mesh", {}), **extra.get("mesh", {})})
    speculative = _build(SpeculativeSettings, {**data.get("speculative", {}), **extra.get("speculative", {})})
    if model.linear.layers:
        engine, mesh = hybrid_settings(model, engine, mesh, speculative.enabled)
    if speculative.method == "mtp":  # the checkpoint's MTP layer runs too (engine/speculative/mtp_settings.py)
        model = mtp_model(model, speculative)
    lora = _build(LoraSettings, {**data.get("lora", {}), **extra.get("lora", {})})
    config = Config(name=name, model=model, engine=engine, mesh=mesh, model_path=model_path, speculative=speculative,
                    lora=lora)
    validate(config)  # every combination refused here, before any weight is read
    return config


def hybrid_settings(model: ModelConfig, engine: EngineSettings, mesh: MeshSettings,
                    speculative: bool = False) -> tuple[EngineSettings, MeshSettings]:
    """A linear-attention hybrid's engine today: heads split over mesh.tensor, a state slot
    per running request (two with speculative decoding: the second keeps the state before
    a verification, engine/scheduler/verification.py), prefix caching through state
    snapshots (engine/scheduler/state_snapshots.py), which the host tier keeps too (engine/kv_tier/snapshot_offload.py), and an int8 / fp8 KV cache
    for the attention layers (the linear layers' state stays f32). What it cannot do yet is
    refused by engine/capabilities/table.py (RULES)."""
    interval, slots = int(engine.state_snapshot_tokens), int(engine.state_snapshot_slots)
    caching = engine.enable_prefix_caching and interval > 0
    if engine.enable_prefix_caching and not caching:
        log.info("linear-attention hybrid: prefix caching off (engine.state_snapshot_tokens = 0)")
    slots = (slots or engine.max_num_seqs) if caching else 0
    working = engine.max_num_seqs * (2 if speculative else 1)
    return (dataclasses.replace(engine, enable_prefix_caching=caching, state_slots=working, state_snapshot_slots=slots),
            dataclasses.replace(mesh, cpu_split=False))


def _fit_max_model_len(values: dict[str, Any], explicit: bool, model: ModelConfig) -> dict[str, Any]:
    """A preset's max_model_len is a default: it shrinks to what the model supports, so a
    checkpoint with a shorter context still loads (values in a TOML file count as preset
    defaults). A value set as an override (`--set`, `overrides=`) stays binding."""
    wanted = int(values.get("max_model_len", EngineSettings.max_model_len))
    limit = model.max_position_embeddings
    if wanted <= limit:
        return values
    if explicit:
        raise ConfigError(f"engine.max_model_len ({wanted}) exceeds the model's max_position_embeddings ({limit})")
    log.warning("engine.max_model_len %d -> %d: the model's max_position_embeddings (set "
                "--set engine.max_model_len=N to choose)", wanted, limit)
    return {**values, "max_model_len": limit}
