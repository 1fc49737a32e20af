"""Host-to-device rates of a layer's fp32 master, plain and staged (cast on the GPU), with and without GEMMs
running beside the copies: where the staged copy loses PCIe's rate (bench/NOTES.md). Prints one JSON line.
Run on the GPU machine from the repo root: PYTHONPATH=src python3 bench/h2d_staging.py"""
import ctypes, json, torch
from slideformer.host.nvme import aligned_empty
from slideformer.host.pinned import pin
libc = ctypes.CDLL("libc.so.6")
N = 218_000_000  # a Llama-8B layer, fp32: 872 MB
dev = torch.device("cuda")
s = torch.cuda.Stream()
a = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16); b = torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16)
stage = torch.empty(16 << 20, device=dev)
def rate(src, dst, piece=None, gemm=False, cast=False, reps=3):
    torch.cuda.synchronize()
    if gemm:
        for _ in range(60): a @ b   # ~150 ms of GEMMs on the compute stream, concurrent with the copies
    with torch.cuda.stream(s):
        e0 = torch.cuda.Event(enable_timing=True); e1 = torch.cuda.Event(enable_timing=True); e0.record(s)
        for _ in range(reps):
            if piece is None:
                dst.copy_(src, non_blocking=True)
            elif cast:
                for st in range(0, src.numel(), piece):
                    m = min(piece, src.numel() - st)
                    stage[:m].copy_(src[st:st+m], non_blocking=True)
                    dst[st:st+m].copy_(stage[:m])
            else:
                for st in range(0, src.numel(), piece):
                    dst[st:st+piece].copy_(src[st:st+piece], non_blocking=True)
        e1.record(s)
    torch.cuda.synchronize()
    return round(reps * src.numel() * src.element_size() / (e0.elapsed_time(e1) / 1e3) / 1e9, 1)
out = {}
gdst = torch.empty(N, device=dev)
gbf = torch.empty(N, device=dev, dtype=torch.bfloat16)
p1 = torch.empty(N, pin_memory=True); p1.fill_(1)
out["torch_pinned"] = rate(p1, gdst); out["torch_pinned_64M"] = rate(p1, gdst, 16 << 20)
del p1
p2 = aligned_empty(N, torch.float32); pin(p2, "x", "y"); p2 = p2[:N]; p2.fill_(1)
out["registered"] = rate(p2, gdst); out["registered_64M"] = rate(p2, gdst, 16 << 20)
out["registered_64M_gemm"] = rate(p2, gdst, 16 << 20, gemm=True)
out["registered_staged_cast"] = rate(p2, gbf, 16 << 20, cast=True)
out["registered_staged_cast_gemm"] = rate(p2, gbf, 16 << 20, cast=True, gemm=True)
p3 = aligned_empty(N, torch.bfloat16); pin(p3, "x", "y"); p3 = p3[:N]; p3.fill_(1)
out["registered_bf16"] = rate(p3, gbf)
out["registered_bf16_gemm"] = rate(p3, gbf, gemm=True)
raw = torch.empty(N * 4 + (2 << 20), dtype=torch.uint8)
off = (-raw.data_ptr()) % (2 << 20)
p4 = raw[off: off + N * 4].view(torch.float32)
out["madvise_rc"] = libc.madvise(ctypes.c_void_p(p4.data_ptr()), ctypes.c_size_t(N * 4), 14)  # MADV_HUGEPAGE
p4.fill_(1); pin(p4, "x", "y")
out["hugepage"] = rate(p4, gdst); out["hugepage_64M_gemm"] = rate(p4, gdst, 16 << 20, gemm=True)
out["hugepage_staged_cast_gemm"] = rate(p4, gbf, 16 << 20, cast=True, gemm=True)
cs = torch.cuda.Stream(priority=-1)
def staged_multi(src, dst, piece, nbuf, gemm=True, reps=3):
    bufs = [torch.empty(piece, device=dev) for _ in range(nbuf)]
    done = [None] * nbuf
    torch.cuda.synchronize()
    if gemm:
        for _ in range(60): a @ b
    with torch.cuda.stream(s):
        e0 = torch.cuda.Event(enable_timing=True); e0.record(s)
        k = 0
        for _ in range(reps):
            for st in range(0, src.numel(), piece):
                m = min(piece, src.numel() - st); j = k % nbuf; k += 1
                if done[j] is not None: s.wait_event(done[j])
                bufs[j][:m].copy_(src[st:st+m], non_blocking=True)
                cs.wait_event(s.record_event())
                with torch.cuda.stream(cs):
                    dst[st:st+m].copy_(bufs[j][:m]); done[j] = cs.record_event()
        s.wait_event(cs.record_event())
        e1 = torch.cuda.Event(enable_timing=True); e1.record(s)
    torch.cuda.synchronize()
    return round(reps * src.numel() * 4 / (e0.elapsed_time(e1) / 1e3) / 1e9, 1)
for piece_mib, nbuf in [(32, 2), (32, 4), (64, 4), (32, 8)]:
    out[f"multi_{piece_mib}MiBx{nbuf}_gemm"] = staged_multi(p2, gbf, piece_mib << 18, nbuf)
out["multi_32MiBx2_nogemm"] = staged_multi(p2, gbf, 32 << 18, 2, gemm=False)
out["thp"] = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
out["AnonHugePages"] = [l.strip() for l in open("/proc/meminfo") if "AnonHuge" in l]
print(json.dumps(out))
