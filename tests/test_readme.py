"""The docs' examples run as written: the notebook example (docs/notebook.md) and its
hand-rolled decode loop give the tokens the engine gives; the README's first set-up
command prints the sample the README quotes."""

import os
import re
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_notebook_example_matches_the_engine():
    from jaxfill import Engine, SamplingParams

    text = open(os.path.join(ROOT, "docs", "notebook.md")).read()
    block = re.search(r"## In a notebook.*?```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "docs/notebook.md", "exec"), namespace)
    prompt, tokens = namespace["prompt"], namespace["tokens"]
    engine = Engine.from_config("tiny", overrides={"engine.num_pages": 32, "engine.max_model_len": 256,
                                                    "engine.token_buckets": [16], "engine.max_num_batched_tokens": 16},
                                progress=False)
    expected = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    assert tokens[len(prompt):] == expected
    assert tokens[:len(prompt)] == prompt


def test_readme_set_up_command_prints_the_quoted_text():
    """The first set-up command's `generate` prints the sample the README quotes."""
    import subprocess
    import sys

    text = open(os.path.join(ROOT, "README.md")).read()
    quoted = re.search(r"`/` marks a line break\) `([^`]+)`", text).group(1)
    command = re.search(r"```bash\n[^\n]*?&& (jaxfill generate [^\n]+)\n", text).group(1)
    args = command.split()[1:]
    args[args.index("--prompt") + 1] = "ROMEO:"  # the README's shell quotes around it
    out = subprocess.run([sys.executable, "-m", "jaxfill.serving.cli", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    printed = " / ".join(line.strip() for line in out.stdout.splitlines() if line.strip())
    assert quoted in printed, (quoted, printed)


def test_readme_embeddings_example_runs():
    """The "Embeddings and scoring" example: two unit vectors of the hidden size, two scores."""
    import contextlib
    import io

    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## Embeddings and scoring.*?```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(block, "README.md", "exec"), namespace)
    vectors, engine = namespace["vectors"], namespace["engine"]
    assert [v.shape for v in vectors] == [(engine.config.model.hidden_size,)] * 2
    assert all(abs(float(v @ v) - 1) < 1e-5 for v in vectors)
