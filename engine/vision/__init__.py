"""Images in prompts: host-side pixels -> patches (image_processor.py), the prompt's
placeholder expansion and 3-axis positions (prompt.py), and the per-image encoder cache
(encoder_cache.py)."""
