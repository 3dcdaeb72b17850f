"""Disaggregated prefill: a prefill engine's prompt KV handed to a decode engine.

    facade.py    engine.disagg, the Engine's collaborator: hold, offer, release, admit prefilled
    handoff.py   held pages, offers and prefilled admissions, under the engine lock
    transfer.py  the rows on the wire (engine/kv_rows.py): JAX's transfer server, offers and pulls
    runner_side.py  the runner's gather and scatter, announced to a multi-process engine's followers
"""
