"""Per-stage busy time of a pipelined step from an XLA:CPU profiler trace (benchmarks/pipeline.py).

XLA:CPU records one event per op (thunk) with its device_ordinal; a collective's wait for
its peers is a nested 'Rendezvous' event. One thread may run several devices' ops in turn,
so time is attributed per device_ordinal, never per thread.
"""

from __future__ import annotations

import json


def _outermost_events(events: list[dict]) -> list[dict]:
    """Per thread, the outermost XLA op events (executor/threadpool regions see-through),
    each with 'wait': the rendezvous time nested inside it (a collective waiting for peers)."""
    by_thread: dict[tuple, list] = {}
    for e in events:
        if not e["name"].startswith(("ThunkExecutor::Execute", "Threadpool")):
            by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        top = None
        for e in evs:
            if top is not None and e["ts"] < top["ts"] + top["dur"]:  # nested in top
                if e["name"].startswith("Rendezvous"):
                    top["wait"] += e["dur"]
                continue
            top = dict(e, wait=0.0)
            out.append(top)
    return out


def stage_profile(trace_path: str, stages: int, microbatches: int) -> list[dict]:
    """Per device (= stage) from an XLA:CPU trace (jax.profiler; op events carry
    device_ordinal; one thread may run several devices' ops in turn): busy time of its
    ops between consecutive ppermutes, i.e. per tick (rendezvous waits taken out; tick 0
    also holds the embedding, and the all-gather + copy before the loop, reported apart).
    Ticks where t - s is outside [0, m) are fill/drain ticks: 'fill_drain_us' (the
    layers are skipped there; what remains is the tick's own bookkeeping and waits)."""
    import gzip

    events = [e for e in json.load(gzip.open(trace_path))["traceEvents"] if e.get("ph") == "X"]
    name = lambda e: e["name"].split(".")[0]  # noqa: E731
    per_device: dict[int, list] = {}
    for e in _outermost_events(events):
        d = (e.get("args") or {}).get("device_ordinal")
        if d is not None:
            per_device.setdefault(int(d), []).append(e)
    rows = []
    for s, mine in sorted(per_device.items()):
        mine.sort(key=lambda e: e["ts"])
        permutes = [i for i, e in enumerate(mine) if name(e) == "ppermute"]
        if not permutes:
            continue
        ticks, lo = [], 0
        for i in permutes:
            ticks.append(sum(e["dur"] - e["wait"] for e in mine[lo:i]))
            lo = i + 1
        pre_loop = sum(e["dur"] - e["wait"] for e in mine[:permutes[0]] if name(e) in ("all-gather", "wrapped_copy"))
        ticks[0] -= pre_loop
        top0: dict[str, float] = {}
        for e in mine[:permutes[0]]:
            top0[name(e)] = top0.get(name(e), 0) + e["dur"] - e["wait"]
        useful = sum(c for t, c in enumerate(ticks) if 0 <= t - s < microbatches)
        window = mine[-1]["ts"] + mine[-1]["dur"] - mine[0]["ts"]
        busy = sum(e["dur"] - e["wait"] for e in mine)
        rows.append({"stage": s, "window_us": window, "busy_us": busy,
                     "rendezvous_wait_us": sum(e["wait"] for e in mine), "pre_loop_gather_copy_us": pre_loop,
                     "tick0_top_events_us": dict(sorted(top0.items(), key=lambda kv: -kv[1])[:6]),
                     "tick_compute_us": ticks, "useful_us": useful, "fill_drain_us": sum(ticks) - useful,
                     "predicted_bubble": (stages - 1) / (microbatches + stages - 1),
                     "bubble_profile": 1 - useful / window})
    return rows
