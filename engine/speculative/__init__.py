"""Speculative decoding: proposals verified as short prefill rows of the ragged step.

    ngram.py       prompt-lookup proposals on the host (pure Python)
    suffix.py      suffix decoding: the request's and recent outputs' continuations (numpy)
    acceptance.py  which proposals a step's sampled rows accept, and the counters stats() reports
    verify_rows.py the rows of a step that verify proposals (batch.py builds them)
    policy.py      when proposing does not pay: the batch-size switch and per-request backoff
    mtp_step.py    the step with the checkpoint's MTP layer as the proposer (models/mtp.py);
                   mtp_rows.py its rows, mtp_settings.py what the config needs
"""
