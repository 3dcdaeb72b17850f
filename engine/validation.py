"""Config -> validated, or one line naming what does not combine and the key to change.

The only place a combination of settings (or of a setting and the model's kinds or
shapes) is refused: the rules of engine/capabilities/table.py, then the checks between values
that belong together (the pool over sequence ranks, buckets over the token budget, the
layers over stages). Settings checked alone stay in their dataclasses (engine/config.py,
models/config/). load_config runs it, and the loader again with the platform before it
builds anything (some rules hold on one platform only); nothing reads a weight first.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxfill.engine.capabilities.table import CAPABILITIES, KINDS, SETTINGS, Rule, model_kinds, refusals
from jaxfill.engine.lora.settings import check_model as check_lora_model
from jaxfill.models.config import ConfigError
from jaxfill.models.execution_plan import scan_period
from jaxfill.models.sharding import head_repeat


def validate(config, platform: str | None = None, extra: tuple[str, ...] = ()) -> None:
    """Raises ConfigError (one line) for the first broken rule or mismatched values.
    platform: jax's backend name when known; extra: flags such as "serve.role=decode"."""
    flags = frozenset(extra) | ({f"platform={platform}"} if platform else frozenset())
    broken = refusals(config, model_kinds(config.model), flags)
    if broken:
        raise ConfigError(describe(broken[0], config))
    check_values(config)


def role_flags(role: str) -> tuple[str, ...]:
    """`serve --role` as rule flags: prefill and decode workers hand KV over (serving/disagg.py)."""
    return ("serve.role=prefill/decode",) if role in ("prefill", "decode") else ()


def describe(rule: Rule, config) -> str:
    """'<arch>: mesh.stage = 2 with mesh.sequence = 2 is refused (why); change mesh.stage ...'"""
    parts = [_condition(c, config) for c in rule.when]
    return (f"{config.model.architecture}: {' with '.join(parts)} is refused ({rule.why}); "
            f"change {rule.change}")


def _condition(cond: str, config) -> str:
    name = cond.lstrip("!")
    if name in CAPABILITIES or name in SETTINGS:
        key = name.split("=")[0]
        section, _, field = key.partition(".")
        value = config.model.value(field) if section == "model" else getattr(getattr(config, section), field)
        return f"{key} = {value!r}" if isinstance(value, str) else f"{key} = {value}"
    if name in KINDS:
        m = config.model
        if name == "linear":
            return f"{m.linear.kind} layers {list(m.linear.layers)}"
        return f"no {name} layers" if cond.startswith("!") else f"{name} layers"
    return name


def check_values(config) -> None:
    """The checks between values of different keys that are not feature combinations."""
    model, engine, mesh = config.model, config.engine, config.mesh
    if model.num_layers % mesh.stage:
        raise ConfigError(f"mesh.stage={mesh.stage} must divide the model's {model.num_layers} layers")
    if engine.scan_layers:
        check_scan_period(model)
    check_stackable(model, model.num_layers // scan_period(model) if engine.scan_layers else mesh.stage)
    if engine.num_pages and (engine.num_pages % mesh.sequence or engine.num_pages < 2 * mesh.sequence):
        raise ConfigError(f"engine.num_pages={engine.num_pages} is the pool's total, dealt over mesh.sequence="
                          f"{mesh.sequence} ranks: it must be a multiple of {mesh.sequence}, at least 2 per rank")
    if bool(engine.disk_kv_cache_dir) != (float(engine.disk_kv_cache_gb) > 0):
        raise ConfigError("the disk KV tier needs both engine.disk_kv_cache_dir and engine.disk_kv_cache_gb > 0, "
                          f"got dir={engine.disk_kv_cache_dir!r}, gb={engine.disk_kv_cache_gb}")
    if engine.token_buckets and max(int(x) for x in engine.token_buckets) < engine.max_num_batched_tokens:
        raise ConfigError(f"engine.token_buckets {tuple(sorted(engine.token_buckets))} must reach "
                          f"engine.max_num_batched_tokens ({engine.max_num_batched_tokens})")
    buckets = engine.decode_buckets
    if not isinstance(buckets, (tuple, list)) or any(isinstance(x, bool) or not isinstance(x, int) or x < 1
                                                     for x in buckets):
        raise ConfigError(f"engine.decode_buckets must be a list of positive token counts (e.g. [1, 2, 4, 8]), "
                          f"got {buckets!r}")
    if mesh.num_processes > 1 and not 0 <= mesh.process_id < mesh.num_processes:
        raise ConfigError(f"mesh.process_id ({mesh.process_id}) must be in [0, {mesh.num_processes})")
    if mesh.num_processes > 1 and not mesh.coordinator:
        from jaxfill.engine.mesh import cluster_env

        if not cluster_env():
            raise ConfigError("mesh.num_processes > 1 needs mesh.coordinator (host:port) outside a TPU pod/cluster")
    if model.linear.layers:
        _check_hybrid(model, engine, mesh)
    check_lora_model(config)
    try:  # the model's shapes against the mesh
        check_mesh(model, mesh)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if model.weight_dtype == "fp8_block":
        _check_fp8_blocks(model, mesh)
    if model.weight_dtype == "int_group":
        _check_int_groups(model, mesh)


def check_mesh(model, mesh) -> None:
    """The model's shapes split as the mesh asks (ValueError naming the key otherwise): heads
    and MLP columns over tensor x expert, experts over expert, layers over stages. Also
    the planner's check (engine/planner/plan.py) and the CPU split's (engine/cpu_devices.py)."""
    tp = mesh.heads
    split = "mesh.tensor" if mesh.expert == 1 else "mesh.tensor x mesh.expert"
    if model.num_heads % tp:
        raise ValueError(f"{split}={tp} does not divide model.num_heads={model.num_heads}")
    for heads in {model.attention_dims(n)[0] for n in range(model.num_layers)}:  # Gemma 4's global layers: their own
        head_repeat(heads, tp)  # raises unless Hkv and the split divide one another
    has_dense = not model.moe.num_experts or bool(model.moe.dense_layers)
    if has_dense and model.intermediate_size % tp:
        raise ValueError(f"{split}={tp} does not divide model.intermediate_size={model.intermediate_size}")
    if model.moe.num_experts and model.moe.num_experts % mesh.expert:
        raise ValueError(f"mesh.expert={mesh.expert} does not divide model.num_experts={model.moe.num_experts}")
    if model.moe.num_experts and model.moe.intermediate_size % mesh.tensor:
        raise ValueError(f"mesh.tensor={mesh.tensor} does not divide "
                         f"model.moe_intermediate_size={model.moe.intermediate_size}")
    if model.num_layers % mesh.stage:
        raise ValueError(f"mesh.stage={mesh.stage} does not divide model.num_layers={model.num_layers}: "
                         "every pipeline stage holds the same number of layers")


def _check_fp8_blocks(model, mesh) -> None:
    """fp8 weights split over devices with their block scales (models/fp8_block.py): a
    device must hold whole blocks, or its share of a scale would serve two devices."""
    from jaxfill.models.families.registry import layer_params
    from jaxfill.models.fp8_block import LAYOUTS, is_fp8, split_error
    from jaxfill.models.sharding import MESH_AXES, RULES, logical_spec, mesh_axis_size

    sizes = _Mesh(MESH_AXES, tuple(int(getattr(mesh, a)) for a in MESH_AXES))
    if 0 in tuple(model.weight_block_size) and model.moe.num_experts:
        raise ConfigError(f"{model.architecture}: model.weight_block_size = {list(model.weight_block_size)} "
                          "(compressed-tensors fp8 channel / tensor scales) on routed experts is not built: use "
                          "model.weight_dtype = auto")
    for kind in {id(ps): ps for ps in (layer_params(model, n) for n in range(model.num_layers))}.values():
        for p in kind:
            if p.path[-1] in LAYOUTS and is_fp8(p.dtype):
                spec = logical_spec(p.axes, RULES, sizes, p.shape)
                why = split_error(p.path[-1], p.shape, p.axes, spec, lambda a: mesh_axis_size(sizes, a),
                                  model.weight_block_size)
                if why:
                    raise ConfigError(f"{model.architecture}: model.weight_dtype = 'fp8_block' with mesh.tensor = "
                                      f"{mesh.tensor}, mesh.expert = {mesh.expert} cuts an fp8 block ({why}); change "
                                      f"mesh.tensor or model.weight_dtype = auto")


def _check_int_groups(model, mesh) -> None:
    """Packed int projections (models/int_group.py): two 4-bit codes a byte along the last
    input axis, and a device holds whole groups of the inputs it splits."""
    import dataclasses

    from jaxfill.models.families.registry import layer_params
    from jaxfill.models.int_group import INPUT_AXES, STACKED, split_error
    from jaxfill.models.sharding import MESH_AXES, RULES, logical_spec, mesh_axis_size

    sizes = _Mesh(MESH_AXES, tuple(int(getattr(mesh, a)) for a in MESH_AXES))
    plain, form = dataclasses.replace(model, weight_dtype="auto"), model.weight_form
    for kind in {id(ps): ps for ps in (layer_params(plain, n) for n in range(model.num_layers))}.values():
        for p in kind:
            if p.path[-1] not in INPUT_AXES or (form.experts_only and p.path[-1] not in STACKED):
                continue
            num_in, stacked = INPUT_AXES[p.path[-1]], STACKED.get(p.path[-1], 0)
            form = model.weight_form.of(p.path[-1])  # a GGUF's projections differ
            if form.bits == 4 and p.shape[stacked + num_in - 1] % 2:
                raise ConfigError(f"{model.architecture}: model.weight_dtype = 'int_group' packs two 4-bit codes a "
                                  f"byte, and {p.path[-1]} {list(p.shape)} has an odd last input axis")
            first = logical_spec(p.axes, RULES, sizes, p.shape)[stacked]
            why = split_error(p.path[-1], p.shape, num_in, mesh_axis_size(sizes, first) if first else 1, form,
                              stacked)
            if why:
                raise ConfigError(f"{model.architecture}: model.weight_dtype = 'int_group' with mesh.tensor = "
                                  f"{mesh.tensor}, mesh.expert = {mesh.expert} cuts a quantization group ({why}); "
                                  "change mesh.tensor")


class _Mesh(NamedTuple):  # what models/sharding.py's logical_spec reads of a mesh
    axis_names: tuple
    axis_sizes: tuple


def _check_hybrid(model, engine, mesh) -> None:
    groups = {"mamba2": "Mamba2 groups (n_groups)", "short_conv": "short-convolution channels (hidden_size)",
              "kda": "KDA heads"}.get(
        model.linear.kind, "linear key heads")
    split = model.hidden_size if model.linear.kind == "short_conv" else model.linear.num_key_heads
    if split % mesh.tensor:
        raise ConfigError(f"{model.architecture}: mesh.tensor = {mesh.tensor} (must divide the {split} {groups})")
    interval, slots = int(engine.state_snapshot_tokens), int(engine.state_snapshot_slots)
    if interval < 0 or interval % engine.page_size or slots < 0:
        raise ConfigError(f"engine.state_snapshot_tokens must be a multiple of engine.page_size "
                          f"({engine.page_size}) and state_snapshot_slots >= 0; got {interval}, {slots}")


def check_scan_period(model) -> None:
    """engine.scan_layers on a hybrid scans one period of its layers per step
    (models/execution_plan.scan_period): a pattern with no period shorter than the model
    would be one step, the unrolled model under another name, so it is refused."""
    period = scan_period(model)
    if model.num_layers > 1 and period == model.num_layers:
        raise ConfigError(f"engine.scan_layers: the model's linear_layers {list(model.linear.layers)} do not repeat "
                          f"with a period that divides its {model.num_layers} layers, so no group of layers "
                          "stacks as one scan step; use engine.scan_layers = false")


def check_stackable(model, groups: int) -> None:
    """Stacked layouts (mesh.stage, engine.scan_layers) stack layer j of every group into
    one module, so those layers must have the same params: in a MoE model with dense
    layers, layer n's kind must depend on n mod (layers per group) only; so must a
    single-block layer's block (Nemotron-H's mixer-only and MLP-only layers), and so must
    a hybrid's mixer (linear or attention: each holds its own kind of cache entry)."""
    if groups <= 1:
        return
    k = model.num_layers // groups
    for name, layers in (("no_mlp_layers", model.no_mlp_layers), ("no_mixer_layers", model.no_mixer_layers),
                         ("linear_layers", model.linear.layers)):
        named = set(layers)
        if any((n in named) != (n % k in named) for n in range(model.num_layers)):
            raise ConfigError(f"the model's {name} {sorted(named)} differ between the {groups} stacked layer "
                              "groups (mesh.stage / engine.scan_layers); use the unrolled layout")
    if not model.moe.num_experts or not model.moe.dense_layers:
        return
    dense = set(model.moe.dense_layers)
    if any((n in dense) != (n % k in dense) for n in range(model.num_layers)):
        raise ConfigError(f"the model's dense layers {sorted(dense)} differ between the {groups} stacked layer "
                          f"groups (mesh.stage / engine.scan_layers), which stack layer j of every group as one; "
                          "use the unrolled layout (mesh.stage = 1, engine.scan_layers = false)")
