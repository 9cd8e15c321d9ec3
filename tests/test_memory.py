"""Page-sized buffers come from their own memory mappings once an engine is built.

glibc raises its mmap threshold to the size of each large block freed; a freed 11 MB page image
then sends the next ones into the heap, which fragments it and lifts the peak resident size of
long runs. ``pin_mmap_threshold`` fixes the threshold (4 MiB). Each case runs in a fresh
interpreter: the setting is process-wide.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt/mallinfo2: Linux")

# Frees a 20 MiB block (which lifts glibc's dynamic threshold past 6 MiB), then counts how many
# mmapped blocks a 6 MiB allocation adds (mallinfo2().hblks): 1 when pinned, 0 when it came from the heap.
PROBE = """
import ctypes, sys
class MallInfo2(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "pin":
    from mineru_fast.engine.memory import pin_mmap_threshold
    print(pin_mmap_threshold(), end=" ")
libc.free(libc.malloc(20 << 20))
before = libc.mallinfo2().hblks
block = libc.malloc(6 << 20)
print(libc.mallinfo2().hblks - before)
"""


def probe(mode: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | env
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=environ, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_page_sized_block_is_mapped_once_pinned_and_heaped_without():
    assert probe("plain") == "0"  # glibc's dynamic threshold: the 6 MiB block came from the heap
    assert probe("pin") == "True 1"


def test_the_users_own_glibc_setting_stays_in_charge():
    assert probe("pin", MALLOC_MMAP_THRESHOLD_=str(64 << 20)) == "False 0"
