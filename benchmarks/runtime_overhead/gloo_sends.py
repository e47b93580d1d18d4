"""When does a gloo send posted before its receive arrive: while the sender computes, or when it next calls into gloo?

Rank 0 posts ``isend`` at once and then computes for 300 ms (one thread, matrix products)
before it waits on the send; rank 1 computes for 50 ms, then posts ``irecv`` and waits. A
send that moves only when the sender next calls into gloo arrives at about 300 ms; one that
gloo's own threads move arrives just after 50 ms. Five repeats per message size, on 2 gloo
processes over 127.0.0.1; run it alone on the machine (docs/design.md, finding 10).

    python benchmarks/runtime_overhead/gloo_sends.py
"""
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def busy(seconds: float) -> None:
    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = (a @ a).tanh_()

def worker(rank, port, q, nbytes, late_s, sender_busy_s):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.zeros(nbytes // 4)
    res = []
    for rep in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            w = dist.isend(x, 1)
            busy(sender_busy_s)
            w.wait()
        else:
            busy(late_s)
            w = dist.irecv(x, 0)
            w.wait()
            res.append(time.perf_counter() - t0)
    if rank == 1:
        q.put(res)
    dist.destroy_process_group()

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    for nbytes in (4096, 1 << 20):
        q = ctx.Queue()  # rank 1's arrival times
        ps = [ctx.Process(target=worker, args=(r, 29650 + nbytes % 97, q, nbytes, 0.05, 0.3)) for r in range(2)]
        for p in ps:
            p.start()
        res = q.get(timeout=120)
        for p in ps:
            p.join(60)
        print(f"{nbytes} B: receiver posts at 50 ms, sender busy 300 ms: received at", " ".join(f"{r*1e3:.0f}" for r in res), "ms")
