"""The model families dtorch_hf registers itself (one module per family)."""
