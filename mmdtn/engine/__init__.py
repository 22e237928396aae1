"""Training and testing support: multi-process runs on CPU-only machines (gloo)."""
from .distributed import (CPUDistributedDataParallel, init_cpu_process_group,
                          needs_cpu_distributed, setup_distributed)

__all__ = ['CPUDistributedDataParallel', 'init_cpu_process_group', 'needs_cpu_distributed',
           'setup_distributed']
