"""Communicators: how the workers of one mesh-dim group exchange tensors."""
