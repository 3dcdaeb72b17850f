"""Which features and model kinds combine: one table, the tests behind it, and what is derived.

    table.py           the capability table: every refusal of a combination is one of its rules
    evidence.py        the test that runs each tested cell of the matrix
    support_matrix.py  per architecture: tested / untested / refused (`jaxfill models`, the
                       README's matrix, docs/capabilities.md: `python -m
                       jaxfill.engine.capabilities.support_matrix` regenerates the documents)

engine/validation.py applies the table to a config, before any weight is read.
"""
