"""The README's notebook example runs as written."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_notebook_example_runs():
    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## In a notebook.*?```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert len(namespace["tokens"]) == len(namespace["prompt"]) + 4
