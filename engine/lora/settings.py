"""The [lora] section: how many adapters the device holds at once, their largest rank, and
how many the host keeps loaded beside them.

    [lora]
    max_loras = 4        # device slots (0 = LoRA off: the step program is the base model's)
    max_lora_rank = 16   # every slot's A / B are padded to this rank
    max_cpu_loras = 8    # adapters kept in host memory (0 = max_loras); past it the least
                         # recently used is dropped and re-read from its directory on use

Which models and layouts take LoRA is the capability table's (engine/capabilities/table.py,
the rules on `lora.max_loras`); `check_model` adds the families the tests cover.
"""

from __future__ import annotations

import dataclasses

from jaxfill.models.config import ConfigError

# The families whose projections models/lora.py maps from PEFT names and the tests compare
# with transformers + peft (tests/test_lora.py); others are refused by name.
LORA_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int = 0

    def __post_init__(self):
        for name, low in (("max_loras", 0), ("max_lora_rank", 1), ("max_cpu_loras", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"lora.{name} must be an integer >= {low}, got {value!r}")
        if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"lora.max_cpu_loras ({self.max_cpu_loras}) must be >= lora.max_loras "
                              f"({self.max_loras}): every adapter on the device has a host copy (0 = max_loras)")

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


def check_model(config) -> None:
    """One line naming what LoRA does not cover yet for this model (the table's kinds and
    layouts are refused before this: engine/validation.py)."""
    if not config.lora.enabled:
        return
    arch = config.model.architecture
    if arch not in LORA_ARCHITECTURES:
        raise ConfigError(f"{arch}: lora.max_loras = {config.lora.max_loras} is refused (LoRA adapters are mapped "
                          f"and tested for {', '.join(LORA_ARCHITECTURES)} only); change lora.max_loras = 0")
