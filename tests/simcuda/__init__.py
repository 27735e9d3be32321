"""The simulated-CUDA checks of tests/test_cuda_simulated.py: checks.py (run in child processes
started by children.py) and the seeded device bugs of seeds.py. The harness they run on is
tools/simcuda/ (its README says how it works, what it proves and what it cannot)."""
