# (issue 28, pass 6; PYTHONPATH=. python docs/ina_live/pass6/profile/<this file> ...; output beside it as .txt)
import numpy as np, time
def bench(f, n=2000):
    f(); t=time.thread_time()
    for _ in range(n): f()
    return (time.thread_time()-t)/n*1e6
k=65536
x=(np.random.randn(k)*1e-2).astype(np.float32); t=np.empty(k,np.float32); d=np.empty(k,np.int32); s=np.float32(2.0**30)
print("mul us", bench(lambda: np.multiply(x,s,out=t)))
print("rint->int32 us", bench(lambda: np.rint(t,out=d,casting='unsafe')))
print("rint inplace us", bench(lambda: np.rint(t,out=t)))
print("copyto cast us", bench(lambda: np.copyto(d,t,casting='unsafe')))
print("astype us", bench(lambda: t.astype(np.int32)))
print("int->float cast us", bench(lambda: np.copyto(t,d,casting='unsafe')))
print("mul int*float->float us", bench(lambda: np.multiply(d,s,out=t,dtype=np.float32,casting='unsafe')))
print("max us", bench(lambda: x.max()))
print("min us", bench(lambda: x.min()))
import torch
tx=torch.from_numpy(x); tt=torch.from_numpy(t); td=torch.from_numpy(d)
torch.set_num_threads(1)
print("torch mul", bench(lambda: torch.mul(tx, 2.0**30, out=tt)))
print("torch round_", bench(lambda: tt.round_()))
print("torch copy to int", bench(lambda: td.copy_(tt)))
print("torch aminmax", bench(lambda: torch.aminmax(tx)))
