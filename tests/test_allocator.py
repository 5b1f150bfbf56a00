"""allocator.keep_freed_memory: large tensors come from the process's heap, not from fresh mappings."""

import subprocess
import sys

import pytest

PROBE = """
import sys, torch
if sys.argv[1] == "keep":
    from specdecode.allocator import keep_freed_memory
    assert keep_freed_memory()
tensor = torch.empty(48 << 20, dtype=torch.uint8)  # above glibc's largest dynamic mmap threshold (32 MiB)
address = tensor.data_ptr()
for line in open("/proc/self/maps"):
    low, high = (int(x, 16) for x in line.split()[0].split("-"))
    if low <= address < high:
        print("heap" if line.rstrip().endswith("[heap]") else "mapping")
"""


def _where(mode: str) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc/self/maps are Linux's")
def test_large_tensors_come_from_the_heap():
    if _where("default") != "mapping":
        pytest.skip("this C library already serves 48 MiB from the heap")
    assert _where("keep") == "heap"
