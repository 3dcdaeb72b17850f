"""The executors: a layer run over one mesh axis in a shard_map, by the rules of
models/sharding.py. Each is a no-op without a mesh in context (or with its axis of size 1).

    data.py            'data': the whole forward mapped over the replicas
    expert.py          'expert' (and 'tensor'): a MoE layer's experts, one all-reduce
    heads.py           'tensor': mixers whose heads never talk (Gated DeltaNet, Mamba2)
    vocab.py           'tensor' x 'stage': the embedding lookup in a vocab-split table
    context.py         'sequence': pass-Q attention over a page pool dealt over the ranks
    ring_attention.py  'sequence': the pass-KV ring for a step with nothing cached
    pipeline.py        'stage': layers stacked per stage, GPipe microbatches in one step
"""
