"""Engine.embed and Engine.score against sentence-transformers and transformers on random-init
Qwen3 and Llama checkpoints with sentence-transformers' module files beside them: the
checkpoint's pooling (Qwen3: last token, normalized; Llama: mean, not normalized), every
mode / normalization asked per call, whole prompts and chunked prefill (a 16-token budget
cuts the 40-token prompt into three steps); a mixed step of embeddings and generation gives
each its results alone; a bare Qwen3-Embedding layout (no `model.` prefix, no lm_head) loads,
embeds the same and refuses to generate; the CausalLM reranker's p(yes) equals
transformers'; bad inputs are refused with every page back. One small engine per case."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from embed_refs import assert_close, hidden_states, pool, st_vectors, torch, write_st_modules
from hf_models import make_hf_checkpoint
from jaxfill.engine.engine import Engine
from jaxfill.engine.request import InvalidRequest, SamplingParams

BASE = {"engine.num_pages": 40, "engine.max_model_len": 64, "engine.max_num_seqs": 4, "mesh.cpu_split": False,
        "engine.kv_fill_value": float("nan")}
PROMPTS = [list(np.random.default_rng(n).integers(3, 500, n)) for n in (5, 23, 40)]
CHECKPOINT_POOLING = {"qwen3": ("last", True), "llama": ("mean", False)}  # what their module files say
YES_NO = [11, 22]  # the reranker's "yes" and "no" token ids (model.score_token_ids)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(family: str) -> str:
        if family not in made:
            d = make_hf_checkpoint(str(tmp_path_factory.mktemp(family)), family)
            made[family] = write_st_modules(d, *CHECKPOINT_POOLING[family], hidden=64)
        return made[family]
    return get


@pytest.fixture(scope="module")
def engine(checkpoint):
    built = {}

    def get(family: str, budget: int = 64, path: str | None = None) -> Engine:
        key = (family, budget, path)
        if key not in built:
            overrides = {**BASE, "engine.max_num_batched_tokens": budget, "engine.token_buckets": [budget]}
            if family == "qwen3":
                overrides["model.score_token_ids"] = YES_NO
            built[key] = Engine.from_config("tiny", model_path=path or checkpoint(family), overrides=overrides,
                                            progress=False)
        return built[key]
    return get


def all_pages_back(engine: Engine) -> bool:
    st = engine.stats()
    return st["pages_free"] == st["pages_total"] and not engine.has_unfinished()


@pytest.mark.parametrize("family,budget", [("qwen3", 64), ("qwen3", 16), ("llama", 64), ("llama", 16)],
                         ids=["qwen3", "qwen3-chunked", "llama", "llama-chunked"])
def test_embeddings_equal_the_references(checkpoint, engine, family, budget):
    import transformers as tf

    eng = engine(family, budget)
    mode, normalize = CHECKPOINT_POOLING[family]
    assert (eng.config.model.pooling.mode, eng.config.model.pooling.normalize) == (mode, normalize)
    for got, want in zip(eng.embed(PROMPTS), st_vectors(checkpoint(family), PROMPTS)):
        assert_close(got, want, normalize)
    hidden = hidden_states(tf.AutoModel.from_pretrained(checkpoint(family), dtype=torch.float32).eval(), PROMPTS)
    for mode in ("last", "mean", "cls"):
        for normalize in (False, True):
            got = eng.embed(PROMPTS, pooling=mode, normalize=normalize)
            for g, h in zip(got, hidden):
                assert g.dtype == np.float32 and g.shape == (64,)
                assert_close(g, pool(h, mode, normalize), normalize)
    assert all_pages_back(eng)


def test_mixed_batch_gives_each_its_results_alone(engine):
    eng = engine("qwen3")
    gen_prompt, params = PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True)
    alone_vectors = eng.embed(PROMPTS, pooling="mean")
    alone_tokens = eng.generate([gen_prompt], params)[0].token_ids
    kinds = []  # per step: whether it held pooling rows, generation rows
    build = eng.core._phases.build

    def spy(launch, outputs):
        kinds.append({sch.req.pooling is not None for sc in launch.scheds for sch in sc.seqs})
        return build(launch, outputs)
    eng.core._phases.build = spy
    try:
        rid = eng.add_request(gen_prompt, params)
        vectors = eng.embed(PROMPTS, pooling="mean")
        tokens = []
        while eng.has_unfinished():
            tokens += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    finally:
        eng.core._phases.build = build
    assert {True, False} in kinds  # a step held both
    assert tokens == alone_tokens
    for got, want in zip(vectors, alone_vectors):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert all_pages_back(eng)


def test_bare_backbone_layout_loads_embeds_and_refuses_generate(checkpoint, engine, tmp_path):
    from safetensors.numpy import load_file, save_file

    src = checkpoint("qwen3")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file({k.removeprefix("model."): v for k, v in tensors.items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))
    for name in ("config.json", "modules.json", "1_Pooling"):
        (shutil.copytree if name == "1_Pooling" else shutil.copy)(os.path.join(src, name), tmp_path / name)
    assert not json.load(open(tmp_path / "config.json")).get("tie_word_embeddings")
    bare = engine("qwen3", path=str(tmp_path))
    assert not bare.config.model.embeddings.head
    for got, want in zip(bare.embed(PROMPTS), engine("qwen3").embed(PROMPTS)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidRequest, match="no LM head"):
        bare.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
    assert all_pages_back(bare)


def test_reranker_p_yes_equals_transformers(checkpoint, engine):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(checkpoint("qwen3"), dtype=torch.float32).eval()
    query, docs = PROMPTS[0], [PROMPTS[1], PROMPTS[2][:20], [7, 8, 9]]
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([query + d])).logits[0, -1].double() for d in docs]
    want = [torch.softmax(lg[YES_NO], 0)[0].item() for lg in logits]
    got = engine("qwen3").score(query, docs)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert max(want) - min(want) > 1e-3  # the documents score differently
    assert all_pages_back(engine("qwen3"))


def test_cosine_score_of_an_embedding_model(engine):
    eng = engine("llama")
    q, *docs = eng.embed([PROMPTS[0], PROMPTS[1], PROMPTS[2]])
    want = [float(q @ d / np.linalg.norm(q) / np.linalg.norm(d)) for d in docs]
    np.testing.assert_allclose(eng.score(PROMPTS[0], PROMPTS[1:]), want, atol=1e-6)


def test_bad_inputs_are_refused_with_every_page_back(engine):
    eng = engine("llama")
    for bad, match in (([], "empty"), ("", "empty"), ([5] * 64, "max_model_len"), ([5, 10**6], "vocabulary")):
        with pytest.raises(ValueError, match=match):
            eng.embed([PROMPTS[0], bad])
    with pytest.raises(ValueError, match="pooling"):
        eng.embed([PROMPTS[0]], pooling="max")
    assert all_pages_back(eng)
    assert len(eng.embed([PROMPTS[0]])) == 1


def test_sequence_classifier_scores_equal_transformers(tmp_path):
    """Qwen3ForSequenceClassification: the decoder without an LM head, score.weight on the
    last token; Engine.score gives sigmoid(logit), transformers' logits through the same sigmoid."""
    import transformers as tf

    from hf_models import FAMILY_KWARGS, HF_SMALL

    torch.manual_seed(0)
    model = tf.Qwen3ForSequenceClassification(tf.Qwen3Config(**{**HF_SMALL, **FAMILY_KWARGS["qwen3"][1]},
                                                             num_labels=1, pad_token_id=0)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    eng = Engine.from_config("tiny", model_path=str(tmp_path), progress=False,
                             overrides={**BASE, "engine.max_num_batched_tokens": 64, "engine.token_buckets": [64]})
    assert eng.config.model.pooling.num_labels == 1 and not eng.config.model.embeddings.head
    query, docs = PROMPTS[0], [PROMPTS[1], PROMPTS[2][:20], [7, 8, 9]]
    with torch.no_grad():
        want = [torch.sigmoid(model(input_ids=torch.tensor([query + d])).logits[0, 0]).item() for d in docs]
    np.testing.assert_allclose(eng.score(query, docs), want, atol=1e-5)
    assert max(want) - min(want) > 1e-3
    with pytest.raises(InvalidRequest, match="no LM head"):
        eng.generate([query], SamplingParams(max_tokens=2))
    assert all_pages_back(eng)
