"""Runners: where workers run and how batches reach them (base, inline, thread, process)."""
