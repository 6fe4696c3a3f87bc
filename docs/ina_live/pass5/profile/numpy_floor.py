import numpy as np, time
n, k = 875000, 16000
full = n // k
x = (np.random.randn(n) * 1e-2).astype(np.float32)
body = x[:full*k].reshape(full, k)
lanes = np.zeros((full, k), np.int32)
tmp = np.empty((1, k), np.float32)
out = np.empty(n, np.float32)
regs = [np.random.randint(-1000, 1000, (full, k)).astype(np.int32) for _ in range(4)]
R = np.zeros((full, k), np.int32)
def t(f, r=20):
    f(); a = time.thread_time()
    for _ in range(r): f()
    return (time.thread_time() - a) / r * 1e3
sc = np.full((full, 1), 2.0**20, np.float32)
def peaks(): np.maximum(body.max(axis=1, initial=0.0), -body.min(axis=1, initial=0.0))
def quant():
    for r in range(full):
        np.multiply(body[r:r+1], sc[r:r+1], out=tmp); np.rint(tmp, out=lanes[r:r+1], casting="unsafe")
def quant_whole():
    t_ = body * sc; np.rint(t_, out=lanes, casting="unsafe")
def deq(): np.multiply(lanes, sc, out=out[:full*k].reshape(full, k), dtype=np.float32, casting="unsafe")
def sw():
    R[...] = regs[0]
    for q in regs[1:]: np.add(R, q, out=R)
def sw_block():
    for r in range(0, full, 8):
        R[r:r+8] = regs[0][r:r+8]
        for q in regs[1:]: np.add(R[r:r+8], q[r:r+8], out=R[r:r+8])
import torch
tx = torch.from_numpy(x[:full*k]).view(full, k)
def taminmax(): torch.aminmax(tx, dim=1)
tl = torch.from_numpy(lanes)
ts = torch.from_numpy(sc)
tt = torch.empty(full, k)
def tquant(): torch.mul(tx, ts, out=tt); tt.round_(); tl.copy_(tt)
def clone(): x.copy()
for f in (peaks, taminmax, quant, quant_whole, tquant, deq, sw, sw_block, clone):
    print(f.__name__, round(t(f), 3), "ms")
