"""Multi-LoRA served per request (the model side: models/lora.py).

    settings.py  the [lora] section and the families LoRA covers
    adapter.py   a PEFT adapter directory -> host arrays in the slot tables' layout
    slots.py     adapters by name: host LRU, device slots, acquire per request
"""
