"""Simulated CUDA: the project's CUDA paths on a machine without a GPU (README.md says how, what it
proves and what it cannot). Importing this package does not import torch: preload() must run
first in a process that uses the simulation."""
from .harness import (H100, H100_BYTES_PER_S, PROJECT_FILES, FakeProcessGroup, SimCUDAError,
                      SimulatedCUDA, build, flash_attention_as_on_h100, fused_rms_norm_as_on_cuda,
                      preload, unsupported)

__all__ = ["H100", "H100_BYTES_PER_S", "PROJECT_FILES", "FakeProcessGroup", "SimCUDAError",
           "SimulatedCUDA", "build", "flash_attention_as_on_h100", "fused_rms_norm_as_on_cuda",
           "preload", "unsupported"]
