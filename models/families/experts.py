"""The HF tensor names of a mixture-of-experts MLP (models/moe.py): the router, the
per-expert projections stacked into experts_gate_up [E, H, 2, I] and experts_down
[E, I, H], and the shared expert where there is one."""

from __future__ import annotations

from jaxfill.models.families.base import HFTensor


def expert_tensors(c, p: str, layer: tuple, block: str = "mlp",
                   names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                   router: str = "gate") -> dict:
    """{HF name: HFTensor} of one MoE layer whose experts are `{p}{block}.experts.{j}.{name}`."""
    e, h, i, n = c.hidden_size, c.hidden_size, c.moe.intermediate_size, c.moe.num_experts
    m = layer + ("mlp",)
    table = {f"{p}{block}.{router}.weight": HFTensor(m + ("router",), (n, h), (n, h), (1, 0))}
    gate, up, down = names
    for j in range(n):
        x = f"{p}{block}.experts.{j}."
        for slot, name in enumerate((gate, up)):  # [I, H] -> [H, I], row j slot `slot` of [E, H, 2, I]
            table[x + name + ".weight"] = HFTensor(m + ("experts_gate_up",), (i, e), (i, e), (1, 0),
                                                   stack=((0, j, n), (2, slot, 2)))
        table[x + down + ".weight"] = HFTensor(m + ("experts_down",), (e, i), (e, i), (1, 0), stack=((0, j, n),))
    return table


def shared_expert_tensors(c, p: str, layer: tuple, block: str = "mlp", name: str = "shared_expert",
                          gate: str | None = "shared_expert_gate") -> dict:
    e, i = c.hidden_size, c.moe.shared_expert_size
    s = layer + ("mlp", "shared")
    table = {
        f"{p}{block}.{name}.gate_proj.weight": HFTensor(s + ("gate",), (i, e), (i, e), (1, 0)),
        f"{p}{block}.{name}.up_proj.weight": HFTensor(s + ("up",), (i, e), (i, e), (1, 0)),
        f"{p}{block}.{name}.down_proj.weight": HFTensor(s + ("down",), (e, i), (e, i), (1, 0)),
    }
    if gate and c.moe.shared_expert_gate:
        table[f"{p}{block}.{gate}.weight"] = HFTensor(layer + ("mlp", "shared_gate"), (1, e), (1, e), (1, 0))
    return table


def grouped_sigmoid_moe_tensors(c, p: str, layer: tuple) -> dict:
    """DeepSeek V3's MoE layer as GLM-4.5 has it too: the experts, the router's
    `e_score_correction_bias` and the `shared_experts`."""
    table = expert_tensors(c, p, layer)
    table[f"{p}mlp.gate.e_score_correction_bias"] = HFTensor(layer + ("mlp", "router_bias"), (c.moe.num_experts,),
                                                             (c.moe.num_experts,), (0,))
    if c.moe.shared_expert_size:
        table.update(shared_expert_tensors(c, p, layer, name="shared_experts", gate=None))
    return table
