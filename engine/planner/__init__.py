"""The prefill planner (`jaxfill plan`): what a prompt costs on a model, a mesh and a device,
by arithmetic alone; nothing here runs on a device.

    plan.py      the plan: per-device time (FLOPs, bytes, collectives), TTFT floor, the KV pool
    counts.py    FLOPs and bytes from the model shape alone
    layout.py    what one device holds under a mesh (weights, KV per token)
    context.py   the 'sequence' (context parallel) forms and what they send
    hardware.py  accelerator specs (configs/hardware.toml), or this CPU measured
"""
