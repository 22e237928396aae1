"""Training and testing support: multi-process runs on CPU-only machines (gloo)."""
from .distributed import (CPUDistributedDataParallel, close_distributed, exit_process,
                          init_cpu_process_group, needs_cpu_distributed, setup_distributed)

__all__ = ['CPUDistributedDataParallel', 'close_distributed', 'exit_process',
           'init_cpu_process_group', 'needs_cpu_distributed', 'setup_distributed']
