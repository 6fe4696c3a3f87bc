"""(issue 28, pass 7) Two processes ping-pong a 40-byte UDP datagram on loopback, each blocking in poll as the live roles do: round-trip time and CPU a wake-up."""
import socket, os, time, select, resource
a=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); a.bind(("127.0.0.1",0))
b=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); b.bind(("127.0.0.1",0))
N=5000
pid=os.fork()
if pid==0:
    p=select.poll(); p.register(b,select.POLLIN); b.setblocking(False)
    for i in range(N):
        p.poll(1000); d,ad=b.recvfrom(65536)
        try: b.recvfrom(65536)
        except BlockingIOError: pass
        b.sendto(d,a.getsockname())
    r=resource.getrusage(resource.RUSAGE_SELF); print("child cpu us per wake", 1e6*(r.ru_utime+r.ru_stime)/N); os._exit(0)
p=select.poll(); p.register(a,select.POLLIN); a.setblocking(False)
t0=time.perf_counter(); r0=resource.getrusage(resource.RUSAGE_SELF)
for i in range(N):
    a.sendto(b"x"*40,b.getsockname()); p.poll(1000); a.recvfrom(65536)
    try: a.recvfrom(65536)
    except BlockingIOError: pass
r=resource.getrusage(resource.RUSAGE_SELF)
print("rtt us", 1e6*(time.perf_counter()-t0)/N, "parent cpu us per rtt", 1e6*((r.ru_utime+r.ru_stime)-(r0.ru_utime+r0.ru_stime))/N)
os.wait()
