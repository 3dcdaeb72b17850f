"""References for the pooling tests: sentence-transformers module files written beside a
random-init HF checkpoint, and the vectors sentence-transformers (or transformers' hidden
states pooled by hand) computes for token ids."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Hugging Face reference needs torch (the test extra)")

FLAGS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def write_st_modules(directory: str, mode: str, normalize: bool, hidden: int) -> str:
    """modules.json and 1_Pooling/config.json as sentence-transformers saves them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    write_word_tokenizer(directory)
    with open(os.path.join(directory, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(directory, "1_Pooling"), exist_ok=True)
    pooling = {"word_embedding_dimension": hidden, **{flag: m == mode for m, flag in FLAGS.items()},
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
               "pooling_mode_weightedmean_tokens": False, "include_prompt": True}
    with open(os.path.join(directory, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f)
    return directory


def write_word_tokenizer(directory: str, vocab_size: int = 512) -> None:
    """A word-level tokenizer ("w7" -> 7): sentence-transformers loads one with the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, vocab_size)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[UNK]").save_pretrained(directory)


def st_vectors(directory: str, prompts: list[list[int]]) -> list[np.ndarray]:
    """sentence-transformers' sentence_embedding of each prompt, one at a time (no padding)."""
    st = pytest.importorskip("sentence_transformers", reason="the reference needs sentence-transformers")
    model = st.SentenceTransformer(directory, device="cpu")
    out = []
    with torch.no_grad():
        for ids in prompts:
            t = torch.tensor([ids])
            out.append(model({"input_ids": t, "attention_mask": torch.ones_like(t)})["sentence_embedding"][0].numpy())
    return out


def hidden_states(model, prompts: list[list[int]]) -> list[np.ndarray]:
    """A transformers base model's last_hidden_state (after the final norm) per prompt: [L, E]."""
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).last_hidden_state[0].double().numpy() for ids in prompts]


def pool(h: np.ndarray, mode: str, normalize: bool) -> np.ndarray:  # [L, E] -> [E]
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[mode]
    return v / np.linalg.norm(v) if normalize else v


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_close(got, want, normalized: bool) -> None:
    """Within 1e-5 cosine, and the norm too (a dropped or extra normalization changes it)."""
    assert 1 - cosine(got, want) < 1e-5, 1 - cosine(got, want)
    assert abs(np.linalg.norm(got) / np.linalg.norm(want) - 1) < 1e-4, (np.linalg.norm(got), np.linalg.norm(want))
    if normalized:
        assert abs(np.linalg.norm(got) - 1) < 1e-5
