"""The README's notebook example runs as written, and its hand-rolled decode loop gives
the tokens the engine gives."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_notebook_example_matches_the_engine():
    from jaxfill import Engine, SamplingParams

    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## In a notebook.*?```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    prompt, tokens = namespace["prompt"], namespace["tokens"]
    engine = Engine.from_config("tiny", overrides={"engine.num_pages": 32, "engine.max_model_len": 256,
                                                    "engine.token_buckets": [16], "engine.max_num_batched_tokens": 16},
                                progress=False)
    expected = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    assert tokens[len(prompt):] == expected
    assert tokens[:len(prompt)] == prompt
