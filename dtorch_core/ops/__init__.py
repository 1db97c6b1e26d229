"""Operator registry and placement signatures (sharding rules) per op family."""
