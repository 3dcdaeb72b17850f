"""Vision towers: image encoders whose output replaces a prompt's image placeholder rows.

config.py reads a checkpoint's vision_config; grid.py lays an image batch out on the host
(patch order, position-table taps, rotary positions, per-image segments); qwen3_vl.py is
Qwen3-VL's ViT with its merger and DeepStack mergers; weights.py fills it from a checkpoint;
siglip.py is Gemma 3's SigLIP tower and multimodal projector, siglip_weights.py fills it;
gemma4_vision.py is Gemma 4's tower (axial 2D rotary, pooler) and embedder, gemma4_weights.py
fills it;
image_processor.py turns pixels into the flattened patches the encoder reads; mrope.py is
the text side's 3-axis rotary positions.
"""
