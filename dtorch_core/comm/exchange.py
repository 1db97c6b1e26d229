"""What a communicator's ``exchange(key, index, size, value, compute)`` may answer besides a result.

Communicators are a lower layer than the worker: the worker imports this marker from here, and
communicators (inprocess.py) return it without importing the worker.
"""

from __future__ import annotations

# the result is not there yet: the worker completes the step later with ``collect`` (lockstep
# runners, see LockstepExchange)
PENDING = object()
