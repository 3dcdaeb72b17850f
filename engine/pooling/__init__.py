"""Pooling requests: Engine.embed and Engine.score (engine/pooling/api.py).

A pooling request is a prompt that is prefilled and never decoded: the step's pooling
variant (engine/step.py) sums its final-norm hidden states per sequence as `rows.py` assigns
them, `vectors.py` gathers the sums across chunks on the host, and the request finishes with
its vector, its pages freed, when its last chunk comes back.
"""
