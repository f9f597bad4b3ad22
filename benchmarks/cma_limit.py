"""The kernel's cross-process copy on this machine, without UCX or NIXL:
``process_vm_readv`` from a child process's memory vs a memcpy, 256 MiB.

    .venv/bin/python benchmarks/cma_limit.py

UCX moves same-node DRAM with CMA (this call), so no NIXL transfer here,
with or without kvd, is faster than this (docs/PERFORMANCE.md, bottleneck 2).
"""
import ctypes
import mmap
import multiprocessing as mp
import time

import numpy as np

libc = ctypes.CDLL("libc.so.6", use_errno=True)
class iovec(ctypes.Structure):
    _fields_=[("iov_base",ctypes.c_void_p),("iov_len",ctypes.c_size_t)]
libc.process_vm_readv.argtypes=[ctypes.c_int, ctypes.POINTER(iovec), ctypes.c_ulong, ctypes.POINTER(iovec), ctypes.c_ulong, ctypes.c_ulong]
libc.process_vm_readv.restype=ctypes.c_ssize_t
def child(q, size):
    m = mmap.mmap(-1, size); a=np.frombuffer(m,dtype=np.uint8); a[:]=7
    q.put(ctypes.addressof(ctypes.c_char.from_buffer(m)))
    time.sleep(60)
def main():
    size=256<<20
    q=mp.Queue(); p=mp.Process(target=child,args=(q,size)); p.start(); raddr=q.get()
    dst=mmap.mmap(-1,size); d=np.frombuffer(dst,dtype=np.uint8); d[:]=1
    laddr=ctypes.addressof(ctypes.c_char.from_buffer(dst))
    src=mmap.mmap(-1,size); s=np.frombuffer(src,dtype=np.uint8); s[:]=2
    for chunk in (4096, 64<<10, 1<<20, 4<<20, size):
        n=size//chunk
        ts=[]
        for r in range(4):
            t0=time.perf_counter()
            # up to 1024 iovs per call (IOV_MAX)
            done=0
            while done<n:
                k=min(1024,n-done)
                L=(iovec*k)(*[iovec(laddr+(done+i)*chunk, chunk) for i in range(k)])
                R=(iovec*k)(*[iovec(raddr+(done+i)*chunk, chunk) for i in range(k)])
                got=libc.process_vm_readv(p.pid, L, k, R, k, 0)
                assert got==k*chunk, (got, ctypes.get_errno())
                done+=k
            ts.append(time.perf_counter()-t0)
        t=sorted(ts)[1]
        print(f"process_vm_readv chunk {chunk>>10} KiB: {size/t/1e9:.2f} GB/s")
    ts=[]
    for r in range(4):
        t0=time.perf_counter(); np.copyto(d, s); ts.append(time.perf_counter()-t0)
    print(f"memcpy: {size/sorted(ts)[1]/1e9:.2f} GB/s")
    p.kill()
if __name__=="__main__": main()
