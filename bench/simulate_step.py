"""A discrete model of one steady-state step with resident and streamed layers, for predictions only.

GPU: forward over layers 0..n-1 (a streamed layer waits for its CPU update from the last step), the loss
head, then backward n-1..0; each streamed layer's gradient needs one of ``buffers`` host buffers, freed
when the CPU has updated that layer. CPU: one update at a time, picking among landed gradients the lowest
layer ("lowest", the engine's order) or the earliest landed ("fifo"). Copies, memory-bandwidth contention
and the resident layers' GPU updates are left out (NOTES, session 4, says what that misses).

    python bench/simulate_step.py            # 4B b8 under 24 GiB: 9 resident layers, per-layer times
"""
from __future__ import annotations

import argparse


def step_time(n=36, resident=9, fwd=0.0036, bwd=0.0108, update=0.0185, head=0.02, buffers=4,
              policy="lowest", steps=6) -> float:
    ready = {i: 0.0 for i in range(resident, n)}  # when each streamed layer's updated weights are ready
    gpu = cpu = 0.0
    last = 0.0
    for _ in range(steps):
        start = gpu
        for i in range(n):
            gpu = max(gpu, ready.get(i, 0.0)) + fwd
        gpu += head
        landed: list[tuple[float, int]] = []
        pending = [i for i in range(n - 1, -1, -1)]
        while pending or landed:
            i = pending[0] if pending else None
            if i is not None and (i < resident or len(landed) < buffers):
                gpu += bwd
                if i >= resident:
                    landed.append((gpu, i))
                pending.pop(0)
                continue
            now = max(cpu, min(t for t, _ in landed))  # the CPU takes the next update
            avail = [x for x in landed if x[0] <= now]
            pick = min(avail, key=lambda x: x[1] if policy == "lowest" else x[0])
            landed.remove(pick)
            cpu = now + update
            ready[pick[1]] = cpu
            if pending and pending[0] >= resident:
                gpu = max(gpu, cpu)  # the GPU was waiting for this buffer
        last = gpu - start
    return last


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resident", type=int, default=9)
    ap.add_argument("--update", type=float, default=0.0185, help="CPU seconds per streamed layer")
    args = ap.parse_args(argv)
    for buffers in (4, 8, 12, 27):
        row = {p: round(step_time(resident=args.resident, update=args.update, buffers=buffers, policy=p), 3)
               for p in ("lowest", "fifo")}
        print(f"{buffers:3d} buffers: {row}")


if __name__ == "__main__":
    main()
