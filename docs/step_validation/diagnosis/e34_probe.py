# Diagnosis e34, part 2: the reference probe timed back to back (python e34_probe.py N), against run 41's calibration
# (outputs/calibration/run41/local.yaml = docs/step_validation/local_opt1.yaml); run from a tree with PYTHONPATH=<tree>.
import sys, json, math, time
from pathlib import Path
import yaml
from atp_pipeline.run.calibrate_compute import reference_probe
from atp_pipeline.planning.compute_profile import host_speed
ref = yaml.safe_load(open('docs/step_validation/local_opt1.yaml'))['device']['compute']['reference']
ref = {g: {k: v * 1e-6 for k, v in d.items()} for g, d in ref.items()}
def main():
  n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
  for i in range(n):
      t = time.time()
      now = reference_probe(4, Path('conf'))
      hs = host_speed(ref, now)
      per = {k: round(now[g][k] / ref[g][k], 2) for g in now for k in now[g]}
      print(f"{i} {time.time()-t:.1f}s compute x{hs.compute:.3f} overhead x{hs.overhead:.3f} {per}", flush=True)

if __name__ == '__main__':
    main()
