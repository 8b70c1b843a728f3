"""The CUDA backend: driver (checked cuda-bindings calls), arena (one allocation, fixed addresses), launch (packed
kernel arguments), graphs (stream capture), doorbell (mapped pinned handoff), weights (device formats, upload),
backend (the Backend protocol on one GPU)."""
