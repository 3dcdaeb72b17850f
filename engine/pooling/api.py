"""Engine.embed and Engine.score: pooling requests run to completion.

Embeddings ride the same ragged prefill step as generation (a step may hold both), one
request per input, pages freed as each finishes. Scoring is either the cosine of two
embeddings (an embedding model) or, with model.score_token_ids = [yes, no], a CausalLM
reranker's p(yes): the softmax over those two tokens' logits at the prompt's last position
(Qwen3-Reranker), computed from the last-token hidden state through the model's own head;
or a sequence-classification head's sigmoid(logit) on the last token (one label).
"""

from __future__ import annotations

import numpy as np

from jaxfill.engine.pooling.head import head_logits, label_logits
from jaxfill.engine.request import InvalidRequest, PoolingParams, QueueFull


def pooling_params(engine, pooling: str | None, normalize: bool | None) -> PoolingParams:
    """The request's pooling: the caller's, else the model's (model.pooling, model.normalize_embeddings)."""
    cfg = engine.config.model.pooling
    if not cfg.enabled:
        raise InvalidRequest("pooling", "this engine is not set up to embed: set model.pooling (last, mean or cls), "
                             "or a checkpoint with sentence-transformers' modules.json sets it")
    mode = pooling or cfg.mode
    if mode == "none":
        raise InvalidRequest("pooling", "model.pooling is none (a reranker): name last, mean or cls")
    return PoolingParams(mode, cfg.normalize if normalize is None else normalize).validate()


def run_pooling(engine, prompts: list, params: PoolingParams) -> list[np.ndarray]:
    """Every prompt checked before any is added; on any exception the added ones are
    aborted (pages back) and the exception propagates."""
    checked = []
    for i, prompt in enumerate(prompts):
        try:
            checked.append(engine.factory.check_pooling(prompt, params))
        except InvalidRequest as e:
            raise InvalidRequest(e.field, f"input {i}: {str(e).removeprefix(e.field + ': ')}") from None
    core = engine.core
    core.refuse_other_steppers()
    rids: list[str] = []
    vectors: dict[str, np.ndarray] = {}
    try:
        while len(vectors) < len(checked):
            while len(rids) < len(checked):
                try:
                    rids.append(core.add_pooling_request(checked[len(rids)], params))
                except QueueFull:
                    break
            mine, others = set(rids), []
            for out in core.step():
                if out.request_id not in mine:
                    others.append(out)
                elif out.finished:
                    done = out.completion
                    if done.embedding is None:
                        raise RuntimeError(f"{out.request_id} ended with {done.finish_reason}: {done.error}")
                    vectors[out.request_id] = done.embedding
            core.return_outputs(others)
        return [vectors[r] for r in rids]
    except BaseException:
        core.discard(rids)
        raise


def embed(engine, inputs, pooling: str | None = None, normalize: bool | None = None) -> list[np.ndarray]:
    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    return run_pooling(engine, inputs, pooling_params(engine, pooling, normalize))


def score(engine, query, documents) -> list[float]:
    documents = [documents] if isinstance(documents, str) else list(documents)
    cfg = engine.config.model.pooling
    if not documents:
        return []
    if cfg.num_labels and cfg.num_labels != 1:
        raise InvalidRequest("documents", f"score needs one label; this classifier has {cfg.num_labels}")
    if cfg.score_token_ids or cfg.num_labels:
        prompts = [_pair(cfg.score_template, query, doc) for doc in documents]
        hidden = np.stack(run_pooling(engine, prompts, PoolingParams("last", False)))
        if cfg.num_labels:  # sigmoid of the one label's logit, as sentence-transformers' CrossEncoder
            logit = label_logits(engine.runner, hidden)[:, 0].astype(np.float64)
        else:  # p(yes) of the softmax over (yes, no) = sigmoid(yes - no)
            yes_no = head_logits(engine.runner, hidden, cfg.score_token_ids).astype(np.float64)  # [n, 2]
            logit = yes_no[:, 0] - yes_no[:, 1]
        return [float(p) for p in 1.0 / (1.0 + np.exp(-logit))]
    vectors = np.stack(embed(engine, [query] + documents)).astype(np.float64)
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return [float(c) for c in unit[1:] @ unit[0]]


def _pair(template: str, query, doc):
    """A reranker's prompt: the template filled with two strings, or two id lists joined."""
    if isinstance(query, str) and isinstance(doc, str):
        return template.replace("{query}", query).replace("{document}", doc)
    if isinstance(query, str) or isinstance(doc, str):
        raise InvalidRequest("prompt", "query and documents must be both strings or both token id lists")
    return list(query) + list(doc)
