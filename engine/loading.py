"""Builds the model and tokenizer a Config describes: HF weights, or a seeded random init."""

from __future__ import annotations

import time

from jaxfill.engine.config import Config
from jaxfill.models.execution_plan import ExecutionPlan
from jaxfill.engine.request import InvalidRequest
from jaxfill.engine.tokenizer import load_tokenizer
from jaxfill.models.families.registry import new_model


def build_mesh(config: Config):
    """Joins the multi-process runtime if configured, then builds the mesh (None: one device).
    A one-device [mesh] on a CPU host may become mesh.tensor = t over t CPU devices
    (engine/cpu_devices.py); engine.mesh.with_mesh_shape puts its sizes in the config.

    Runs before any other device query, as jax.distributed requires."""
    from jaxfill.engine.cpu_devices import cpu_split_mesh
    from jaxfill.engine.mesh import initialize_distributed, make_mesh
    from jaxfill.engine.validation import validate

    validate(config)  # a Config built otherwise than by load_config, before any device work
    initialize_distributed(config.mesh)
    import jax

    validate(config, platform=jax.default_backend())  # the rules that hold on one platform

    if config.mesh.size == 1 and jax.process_count() == 1:
        return cpu_split_mesh(config.model, config.mesh)
    return make_mesh(config.mesh)


def build_model(config: Config, mesh=None, progress: bool = True):
    """Params go straight into their shards when a mesh is given: never whole on one
    device, and each process reads only its own devices' slices of a checkpoint. With
    mesh.stage > 1 (or engine.scan_layers) the model comes in the stacked layout of
    models/parallel/pipeline.py."""
    impl = config.engine.attention_impl
    plan = ExecutionPlan.of_config(config)
    if mesh is not None:
        from flax import nnx

        from jaxfill.engine import placement

        if not config.model_path:
            return nnx.merge(*placement.init_sharded(config.model, mesh, impl, plan=plan))
        _, abstract = placement.abstract_state(config.model, impl, plan)
        place = placement.shard_placer(mesh, abstract)
    else:
        place = None
    if config.model_path:
        from jaxfill.models.checkpoint import default_place, load_hf_params

        return load_hf_params(config.model_path, config.model, attention_impl=impl, place=place or default_place,
                              progress=progress, plan=plan)
    return new_model(config.model, attention_impl=impl, plan=plan)


def build_tokenizer(config: Config):
    return load_tokenizer(config.model, config.model_path)


def validate_prompt(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Rejects what would otherwise fail deep inside a jitted step or be silently cut."""
    if not token_ids:
        raise InvalidRequest("prompt", "is empty")
    bad = [t for t in token_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise InvalidRequest("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise InvalidRequest("prompt", f"has {len(token_ids)} tokens; max_model_len is {max_model_len} "
                             "(prompt plus at least one generated token must fit)")


def timed(label: str, fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start
