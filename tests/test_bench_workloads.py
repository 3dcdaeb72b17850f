"""`jaxfill bench serve` workloads: prefix_repetition round robin, and Zipf over the
prefixes (the RAG shape of benchmarks/kv_tier.py)."""

import argparse
import collections

from jaxfill.serving.bench_load import build_requests


def args(**kw):
    base = dict(seed=0, dataset_name="prefix_repetition", num_prompts=400, prefix_repetition_prefix_len=8,
                prefix_repetition_suffix_len=3, prefix_repetition_num_prefixes=16, prefix_repetition_output_len=2,
                prefix_repetition_zipf=0.0)
    return argparse.Namespace(**{**base, **kw})


def counts(reqs) -> list[int]:
    by_prefix = collections.Counter(tuple(r.prompt[:8]) for r in reqs)
    return sorted(by_prefix.values(), reverse=True)


def test_round_robin_uses_every_prefix_equally():
    reqs = build_requests(args(), vocab_size=320)
    assert counts(reqs) == [25] * 16
    assert all(len(r.prompt) == 11 for r in reqs)


def test_zipf_favours_few_prefixes_and_keeps_a_tail():
    c = counts(build_requests(args(prefix_repetition_zipf=1.1), vocab_size=320))
    assert sum(c) == 400 and len(c) >= 12
    assert c[0] > 4 * c[-1] and c[0] > 400 / 16 * 2  # the head is asked about far more than the tail
