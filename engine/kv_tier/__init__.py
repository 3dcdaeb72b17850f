"""The prefix cache's tiers below the device: pages the device pool evicts, kept on the host
(and on disk) by their prefix hash, and written back on a later hit.

    host.py              the host-memory tier: blocks (one page, every layer) in an LRU byte budget
    disk.py              the disk tier: blocks (and state snapshots) pushed out of the host tier, one file each
    disk_format.py       those files' format: header, checksum, the engine's fingerprint
    page_offload.py      moves KV pages device <-> host tier, never waiting on a copy
    snapshot_offload.py  the same for a linear-attention hybrid's state snapshots
    runner_side.py       the runner's part: saves and restores on the cache it owns (multi-process too)
    restore.py           before a step: the rows that hit the tier get their pages back, or recompute
"""
