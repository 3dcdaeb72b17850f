"""How a config's layers are laid out and run, decided once (loader, planner, model).

`engine.scan_layers` is the stacked layout run one after another by a lax.scan, one group
per scan step: every layer its own group, or in a linear-attention hybrid one period of its
layer pattern (`scan_period`: Qwen3.5's [DeltaNet x3, attention] is one step); `mesh.stage = p` stacks p groups and pipelines them over 'stage'
(models/parallel/pipeline.py); otherwise the layers are unrolled. Only the unrolled layout
with its token rows whole on each device runs the last layer on the sampled rows: the
Decoder reads `prunes_last_layer` from here and the planner counts FLOPs by it, so the two
cannot disagree.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    layer_groups: int = 1  # stacked groups of layers: 1 = unrolled
    microbatches: int = 1  # per step and stage group, when pipelined
    scan: bool = False  # the groups run one after another (engine.scan_layers), not over 'stage'
    prunes_last_layer: bool = True  # the last layer runs on the sampled rows only

    def __post_init__(self):
        if self.prunes_last_layer and self.layer_groups != 1:
            raise ValueError("only the unrolled layout runs the last layer on the sampled rows: a stacked "
                             "layout stacks the last layer with the others")

    @classmethod
    def of(cls, num_layers: int, mesh, scan_layers: bool = False, period: int = 1) -> "ExecutionPlan":
        """`period`: layers per scan step (scan_period of the model)."""
        groups = num_layers // period if scan_layers else mesh.stage
        return cls(groups, mesh.microbatches, bool(scan_layers), groups == 1 and mesh.sequence == 1)

    @classmethod
    def of_config(cls, config) -> "ExecutionPlan":
        return cls.of(config.model.num_layers, config.mesh, config.engine.scan_layers, scan_period(config.model))

    @classmethod
    def unrolled_on(cls, mesh) -> "ExecutionPlan":
        """The unrolled layout on a jax Mesh: the last layer on the sampled rows unless the
        mesh's 'sequence' axis splits the rows."""
        return cls(prunes_last_layer=dict(mesh.shape).get("sequence", 1) == 1)

    @classmethod
    def stacked(cls, groups: int, microbatches: int = 1, scan: bool = False) -> "ExecutionPlan":
        """The stacked layout of `groups` groups (the unrolled one when groups = 1)."""
        return cls(groups, microbatches, scan, prunes_last_layer=groups == 1)

    @property
    def layout(self) -> str:
        if self.layer_groups == 1:
            return "unrolled"
        return "scan" if self.scan else "stages"


def scan_period(model) -> int:
    """Layers per scan step: 1, or in a linear-attention hybrid the shortest period p that
    divides the layer count with layer n linear exactly when layer n mod p is (the stacked
    layout stacks layer j of every group as one module and one cache entry, so those must
    be one kind). A hybrid with no shorter period than its layer count gets that count
    (one group: engine/validation.py refuses it under engine.scan_layers by name)."""
    n, linear = model.num_layers, set(model.linear.layers)
    if not linear:
        return 1
    return next(p for p in range(1, n + 1) if n % p == 0 and all((i in linear) == (i % p in linear) for i in range(n)))
