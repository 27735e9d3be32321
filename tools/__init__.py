"""What bench.py and the tests share that is not part of training: the simulated-CUDA harness
(simcuda/) and the GPU estimate built on it (gpu_estimate.py)."""
