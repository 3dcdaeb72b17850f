"""One module per model family; models/families/registry.py maps architectures to them."""
