"""Why the caching allocator retried: each retry in a torch memory-history trace, with the allocation that
hit the GPU cap and the blocks it had to wait for.

A retry is the allocator finding no free block, and no room under the cap to map a new one: it waits for
every stream's pending events, unmaps its whole free cache and tries again, a wait for the device each
time (``gpu_alloc_retries`` in a benchmark record counts them). The trace shows one as ``segment_unmap``
events before the allocation that failed; the frees completed just before them are blocks that had been let
go by Python but waited for another stream's work (``record_stream``), and how long they had waited says
how far the thread driving the GPU ran ahead. ``slideformer bench --memory-history`` records the trace and
puts this summary in its record.
"""
from __future__ import annotations

OURS = ("slideformer", "transformers", "liger_kernel")  # frames worth naming (not torch's own)


def _where(event: dict, frames: int = 3) -> list[str]:
    return [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in event.get("frames", [])
            if any(o in f["filename"] for o in OURS)][:frames]


def retries(trace: list[dict]) -> list[dict]:
    """Each retry in ``trace`` (one device's ``device_traces`` entries, in order), in order: its time from
    the trace's start (ms), the allocation's size and callers, the bytes allocated and mapped before it, the
    free blocks completed just before it (count, bytes, and how long each had waited since Python let it
    go, ms), and the bytes it unmapped."""
    out: list[dict] = []
    requested: dict[int, int] = {}  # block address -> when Python freed it (free_requested), us
    allocated = mapped = 0
    t0 = trace[0]["time_us"] if trace else 0
    i = 0
    while i < len(trace):
        e = trace[i]
        if e["action"] != "segment_unmap":
            a, size = e["action"], e["size"]
            if a == "alloc":
                allocated += size
            elif a == "free_requested":
                requested[e["addr"]] = e["time_us"]
            elif a == "free_completed":
                allocated -= size
            elif a in ("segment_map", "segment_alloc"):
                mapped += size
            elif a == "segment_free":
                mapped -= size
            i += 1
            continue
        waited, j = [], i - 1
        while j >= 0 and trace[j]["action"] == "free_completed":
            done = trace[j]
            waited.append((done["size"], (done["time_us"] - requested.get(done["addr"], done["time_us"])) / 1e3))
            j -= 1
        unmapped, k = 0, i
        while k < len(trace) and trace[k]["action"] == "segment_unmap":
            unmapped += trace[k]["size"]
            k += 1
        nxt = next((x for x in trace[k:] if x["action"] == "alloc"), None)
        ms = [w for _, w in waited]
        out.append({"at_ms": round((e["time_us"] - t0) / 1e3, 1),
                    "size_mib": None if nxt is None else round(nxt["size"] / 2**20, 1),
                    "where": [] if nxt is None else _where(nxt),
                    "allocated_gib": round(allocated / 2**30, 2), "mapped_gib": round(mapped / 2**30, 2),
                    "freed_blocks": len(waited), "freed_gib": round(sum(s for s, _ in waited) / 2**30, 2),
                    "freed_waited_ms": [round(min(ms), 1), round(max(ms), 1)] if ms else None,
                    "unmapped_gib": round(unmapped / 2**30, 2)})
        mapped -= unmapped
        i = k
    return out
