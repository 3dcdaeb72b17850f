"""Whether a model's shapes split over a mesh: heads, MLP columns and experts over tensor x
expert, layers over stages. Read by engine/validation.py (before any weight is read), the
planner and the CPU split; imports no engine module, so validation stays a leaf.
"""

from __future__ import annotations

from jaxfill.models.sharding import head_repeat


def check_mesh(model, mesh) -> None:  # ModelConfig, MeshSettings
    """The model's shapes split over the mesh, or ValueError naming what does not divide."""
    tp = mesh.heads
    split = "mesh.tensor" if mesh.expert == 1 else "mesh.tensor x mesh.expert"
    if model.num_heads % tp:
        raise ValueError(f"{split}={tp} does not divide model.num_heads={model.num_heads}")
    head_repeat(model.num_kv_heads, tp)  # raises when the KV heads cannot be spread evenly
    has_dense = not model.num_experts or bool(model.dense_layers)
    if has_dense and model.intermediate_size % tp:
        raise ValueError(f"{split}={tp} does not divide model.intermediate_size={model.intermediate_size}")
    if model.num_experts and model.num_experts % mesh.expert:
        raise ValueError(f"mesh.expert={mesh.expert} does not divide model.num_experts={model.num_experts}")
    if model.num_experts and model.moe_intermediate_size % mesh.tensor:
        raise ValueError(f"mesh.tensor={mesh.tensor} does not divide "
                         f"model.moe_intermediate_size={model.moe_intermediate_size}")
    if model.num_layers % mesh.stage:
        raise ValueError(f"mesh.stage={mesh.stage} does not divide model.num_layers={model.num_layers}: "
                         "every pipeline stage holds the same number of layers")
