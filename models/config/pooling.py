"""The `pooling` section of ModelConfig: how a model embeds and scores (engine/pooling/)."""

from __future__ import annotations

import dataclasses

from jaxfill.models.config.errors import ConfigError


POOLING_MODES = ("none", "last", "mean", "cls")


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    """How Engine.embed and Engine.score turn a prompt's final-norm hidden states into a
    vector or a number (engine/pooling/). A checkpoint's sentence-transformers files set
    mode and normalize (models/config/sentence_transformers.py); "none" refuses embed."""
    mode: str = "none"  # "last" token, "mean" over the prompt's rows, "cls" (the first row)
    normalize: bool = False  # L2-normalize each vector (sentence-transformers' Normalize module)
    # a CausalLM reranker (Qwen3-Reranker): score = p(first id) of the softmax over the logits of
    # these two token ids ("yes", "no") at the last position; () = cosine of the embeddings
    score_token_ids: tuple[int, ...] = ()
    # the reranker's prompt: "{query}" and "{document}" are replaced (strings only)
    score_template: str = "{query}{document}"
    # a sequence-classification head (`*ForSequenceClassification`: score.weight [num_labels,
    # hidden] on the last token); 0 = none. Engine.score gives sigmoid(logit) for one label.
    num_labels: int = 0

    @property
    def enabled(self) -> bool:
        """The engine compiles its pooling program (engine/step.py): embed or score is asked for."""
        return self.mode != "none" or bool(self.score_token_ids) or self.num_labels > 0

    def __post_init__(self):
        if self.mode not in POOLING_MODES:
            raise ConfigError(f"model.pooling must be one of {list(POOLING_MODES)}, got {self.mode!r}")
        if int(self.num_labels) < 0:
            raise ConfigError(f"model.num_labels must be >= 0 (0 = no classification head), got {self.num_labels}")
        if len(self.score_token_ids) not in (0, 2):
            raise ConfigError(f"model.score_token_ids must be two ids (yes, no) or empty, "
                              f"got {list(self.score_token_ids)}")
