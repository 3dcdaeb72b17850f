"""How a config's layers are laid out and run, decided once (loader, planner).

`engine.scan_layers` is the stacked layout with every layer its own group, run one after
another by a lax.scan; `mesh.stage = p` stacks p groups and pipelines them over 'stage'
(models/parallel/pipeline.py); otherwise the layers are unrolled. Only the unrolled layout runs
the last layer on the sampled rows (models/decoder.py `prunes_last_layer`), and the
planner counts FLOPs with that same rule.
"""

from __future__ import annotations

import dataclasses

from jaxfill.models.decoder import prunes_last_layer


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
    layer_groups: int  # stacked groups of layers: 1 = unrolled
    microbatches: int  # per step and stage group, when pipelined
    scan: bool  # the groups run one after another (engine.scan_layers), not over 'stage'
    prunes_last_layer: bool  # the last layer runs on the sampled rows only

    @classmethod
    def of(cls, num_layers: int, mesh, scan_layers: bool = False) -> "ExecutionPlan":
        groups = num_layers if scan_layers else mesh.stage
        return cls(groups, mesh.microbatches, bool(scan_layers),
                   prunes_last_layer(groups, rows_split=mesh.sequence > 1))

    @classmethod
    def of_config(cls, config) -> "ExecutionPlan":
        return cls.of(config.model.num_layers, config.mesh, config.engine.scan_layers)

    @property
    def layout(self) -> str:
        if self.layer_groups == 1:
            return "unrolled"
        return "scan" if self.scan else "stages"
