"""heap.trim: the pages a load freed leave the worker's resident memory."""
import subprocess
import sys
import textwrap

import pytest

from mashbox.engine import heap

_CHILD = textwrap.dedent("""
    import sys
    from mashbox.engine import heap

    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

    # 64 MB in 2 KB strings (past pymalloc's 512 B: glibc's heap), then one kept above
    # them so the heap's top cannot shrink by itself: what a load's parsing leaves
    garbage = [bytes(2048) + bytes([i % 256]) for i in range(32768)]
    keep = bytes(4096)
    del garbage
    before = rss()
    assert heap.trim()
    print(before - rss())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_pages_leave_the_resident_set():
    if not heap.trim():
        pytest.skip("no malloc_trim in this libc")
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True)
    released = int(out.stdout.split()[-1])
    assert released > 48 * 2**20, out.stdout
