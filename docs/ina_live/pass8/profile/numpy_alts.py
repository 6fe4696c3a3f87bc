"""(issue 28, pass 8) One process, one thread: the worker's and the switch's numpy passes over small's
875,000-value gradient (float32), the current form against alternatives, thread CPU per sync (median of
REPS). Run: PYTHONPATH=. python docs/ina_live/pass8/profile/numpy_alts.py"""
import os, time, statistics
import numpy as np, torch
torch.set_num_threads(1)
N, K = 875000, int(os.environ.get("K", 16000))
REPS = int(os.environ.get("REPS", 60))
full = N // K
rng = np.random.default_rng(0)
g = (rng.standard_normal(N) * 1e-2).astype(np.float32)
x = g.copy()
body = x[:full * K].reshape(full, K)
lanes = np.zeros((full, K), np.int32)
regs = np.zeros((full, K), np.int32)
sh = (28 - np.frexp(np.abs(body).max(axis=1))[1]).astype(np.int64)
sc = np.exp2(sh).astype(np.float32)[:, None]
isc = np.exp2(-sh).astype(np.float32)[:, None]
wl = [np.random.default_rng(i).integers(-2**28, 2**28, size=(full, K), dtype=np.int32) for i in range(4)]
BLK = 65536
step = max(1, BLK // K)
tmp = np.empty((step, K), np.float32)

def t(f, fresh=True):
    out = []
    for _ in range(REPS):
        if fresh:
            np.copyto(x, g)  # as the benchmark's clone: x just written
        c0 = time.thread_time(); f(); out.append(time.thread_time() - c0)
    return 1e3 * statistics.median(out)

def peaks_cur():
    hi, lo = np.empty(full, np.float32), np.empty(full, np.float32)
    st = max(1, 131072 // K)
    for r in range(0, full, st):
        b = body[r:r + st]; b.max(axis=1, out=hi[r:r + st]); b.min(axis=1, out=lo[r:r + st])
    np.negative(lo, out=lo); return np.maximum(hi, lo, out=hi)
tb = torch.from_numpy(body)
def peaks_torch_aminmax():
    lo, hi = torch.aminmax(tb, dim=1); return torch.maximum(hi, -lo).numpy()
def peaks_torch_norm():
    return torch.linalg.vector_norm(tb, ord=float("inf"), dim=1).numpy()
def peaks_torch_absmax():
    return tb.abs().amax(dim=1).numpy()
ib = body.view(np.uint32)
ut = np.empty((max(1, 131072 // K), K), np.uint32)
def peaks_bits():
    st = max(1, 131072 // K); m = np.empty(full, np.uint32)
    for r in range(0, full, st):
        u = ut[:len(ib[r:r + st])]; np.bitwise_and(ib[r:r + st], 0x7FFFFFFF, out=u); u.max(axis=1, out=m[r:r + st])
    return m.view(np.float32)

def quant_cur():
    for r in range(0, full, step):
        tt = tmp[:min(step, full - r)]
        np.multiply(body[r:r + len(tt)], sc[r:r + len(tt)], out=tt); np.rint(tt, out=tt)
        np.copyto(lanes[r:r + len(tt)], tt, casting="unsafe")
tt_ = torch.from_numpy(tmp); tl = torch.from_numpy(lanes); tsc = torch.from_numpy(sc)
def quant_torch():
    for r in range(0, full, step):
        m = min(step, full - r); tt = tt_[:m]
        torch.mul(tb[r:r + m], tsc[r:r + m], out=tt); torch.round(tt, out=tt); tl[r:r + m].copy_(tt)
def quant_torch_whole():
    tl.copy_(torch.round(tb * tsc))
def quant_np_rint_int():
    for r in range(0, full, step):
        tt = tmp[:min(step, full - r)]
        np.multiply(body[r:r + len(tt)], sc[r:r + len(tt)], out=tt)
        np.rint(tt, out=lanes[r:r + len(tt)], casting="unsafe")

def deq_cur():
    np.multiply(regs, isc, out=body, dtype=np.float32, casting="unsafe")
def deq_blocks():
    for r in range(0, full, step):
        m = min(step, full - r)
        np.copyto(body[r:r + m], regs[r:r + m], casting="unsafe"); np.multiply(body[r:r + m], isc[r:r + m], out=body[r:r + m])
def deq_whole2():
    np.copyto(body, regs, casting="unsafe"); np.multiply(body, isc, out=body)
tr = torch.from_numpy(regs); tisc = torch.from_numpy(isc)
def deq_torch():
    torch.mul(tr, tisc, out=tb)
def deq_torch_blocks():
    for r in range(0, full, step):
        m = min(step, full - r); tb[r:r + m].copy_(tr[r:r + m]); tb[r:r + m].mul_(tisc[r:r + m])

SB = max(1, (1 << 17) // K)
def sum_cur():
    for r in range(0, full, SB):
        d = regs[r:r + SB]; d[...] = wl[0][r:r + SB]
        for w in wl[1:]: np.add(d, w[r:r + SB], out=d)
def sum_fused():
    for r in range(0, full, SB):
        d = regs[r:r + SB]; np.add(wl[0][r:r + SB], wl[1][r:r + SB], out=d)
        for w in wl[2:]: np.add(d, w[r:r + SB], out=d)
def sum_whole_fused():
    np.add(wl[0], wl[1], out=regs); np.add(regs, wl[2], out=regs); np.add(regs, wl[3], out=regs)
twl = [torch.from_numpy(w) for w in wl]
def sum_torch():
    for r in range(0, full, SB):
        d = tr[r:r + SB]; torch.add(twl[0][r:r + SB], twl[1][r:r + SB], out=d)
        for w in twl[2:]: d.add_(w[r:r + SB])

print(f"N={N} K={K} rows={full} reps={REPS} numpy {np.__version__} torch {torch.__version__} (1 thread)")
ref = peaks_cur().copy()
for f in (peaks_cur, peaks_torch_aminmax, peaks_torch_norm, peaks_torch_absmax, peaks_bits):
    assert np.array_equal(np.asarray(f()), ref), f.__name__
    print(f"  {f.__name__:22s} {t(f):6.3f} ms")
quant_cur(); ref = lanes.copy()
for f in (quant_cur, quant_torch, quant_torch_whole, quant_np_rint_int):
    lanes[...] = 0; f(); assert np.array_equal(lanes, ref), f.__name__
    print(f"  {f.__name__:22s} {t(f):6.3f} ms")
regs[...] = sum(w.astype(np.int64) for w in wl).astype(np.int32) >> 2
deq_cur(); ref = body.copy()
for f in (deq_cur, deq_blocks, deq_whole2, deq_torch, deq_torch_blocks):
    body[...] = 0; f(); assert np.array_equal(body, ref), f.__name__
    print(f"  {f.__name__:22s} {t(f):6.3f} ms")
sum_cur(); ref = regs.copy()
for f in (sum_cur, sum_fused, sum_whole_fused, sum_torch):
    regs[...] = 0; f(); assert np.array_equal(regs, ref), f.__name__
    print(f"  {f.__name__:22s} {t(f, fresh=False):6.3f} ms")
