"""Images in prompts: host-side pixels -> patches (image_processor.py), the prompt's
placeholder expansion and 3-axis positions (prompt.py), and the per-image encoder cache
(tower.py); Gemma 3's pixels (gemma3_images.py) and its tower, expansion and image rows
(gemma3_tower.py); Gemma 4's patches (gemma4_images.py) and its tower and expansion
(gemma4_tower.py); loading.py picks the tower a checkpoint has."""
