# (issue 28, pass 6; PYTHONPATH=. python docs/ina_live/pass6/profile/<this file> ...; output beside it as .txt)
import numpy as np, time
N=875000
def bench(f, n=200):
    f(); t=time.thread_time()
    for _ in range(n): f()
    return (time.thread_time()-t)/n*1e3
for k in (2048, 16000):
    m = N//k
    x = (np.random.randn(m*k)*1e-2).astype(np.float32)
    body = x.reshape(m,k)
    sh = np.full(m, 30, dtype=np.int64)
    sc = np.exp2(sh).astype(np.float32)[:,None]
    dst = np.empty((m,k), np.int32)
    out = np.empty((m,k), np.float32)
    def peaks():
        return np.maximum(body.max(axis=1), -body.min(axis=1))
    def peaks_blk(B=65536):
        step=max(1,B//k); p=np.empty(m,np.float32); q=np.empty(m,np.float32)
        for r in range(0,m,step):
            b=body[r:r+step]; b.max(axis=1,out=p[r:r+step]); b.min(axis=1,out=q[r:r+step])
        return np.maximum(p,-q)
    def quant(B):
        step=max(1,B//k); tmp=np.empty((step,k),np.float32)
        for r in range(0,m,step):
            t=tmp[:min(step,m-r)]
            np.multiply(body[r:r+len(t)], sc[r:r+len(t)], out=t)
            np.rint(t, out=dst[r:r+len(t)], casting="unsafe")
    def deq():
        np.multiply(dst, (1/sc), out=out, dtype=np.float32, casting="unsafe")
    def deq_blk(B):
        step=max(1,B//k); isc=(1/sc)
        for r in range(0,m,step):
            o=out[r:r+step]; o[...]=dst[r:r+step]; o*=isc[r:r+step]
    def sw():
        pass
    print(k, "peaks %.3f"%bench(peaks), "peaks_blk64k %.3f"%bench(peaks_blk), "peaks_blk256k %.3f"%bench(lambda: peaks_blk(262144)))
    for B in (16384, 65536, 262144):
        print(k, B, "quant %.3f"%bench(lambda: quant(B)), "deq_blk %.3f"%bench(lambda: deq_blk(B)))
    print(k, "deq %.3f"%bench(deq))
