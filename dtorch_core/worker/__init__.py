"""Workers: execute instruction batches on one device (loop, collectives, programs, streams, kernels)."""
