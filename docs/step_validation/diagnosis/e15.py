"""Diagnosis e15 (issue 27; from e13c's committed data, nothing measured): do the collectives' backend CPU
prices from the pure collective loops (``collective_cpu``, per call and per byte) match gloo's threads' CPU
inside real steps? e13c ran llama_tiny 6x80 on 2 processes (4 points) against run 10's calibration
(local_speed.yaml) and summed every thread's CPU by name over the launch (e13c_ranks.json).

    python docs/step_validation/diagnosis/e15.py
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    rows = json.loads((HERE / "e13c_rows.json").read_text())["rows"]
    ranks = json.loads((HERE / "e13c_ranks.json").read_text())[0]
    total = 0.0
    for r in rows:  # 2 processes: never host-bound, so the rank's predicted CPU = compute + collectives' backend CPU
        coll = r["predicted_rank_cpu_s"] - r["predicted_compute_s"]
        steps = r["samples"] + 2  # the timed steps and the two warm-up steps of the point
        total += coll * steps
        print(f"{r['model']} {r['batch']}x{r['seq_len']} {r['point']}: predicted collectives' CPU {coll * 1e3:.2f} ms a step; "
              f"a rank's CPU measured {r['measured_rank_cpu_s'] * 1e3:.1f} ms, predicted {r['predicted_rank_cpu_s'] * 1e3:.1f} ms "
              f"(x{r['measured_rank_cpu_s'] / r['predicted_rank_cpu_s']:.2f})")
    gloo = [sum(v for k, v in rk["thread_cpu_s"].items() if "gloo" in k) for rk in ranks["ranks"]]
    print(f"over the launch's {rows[0]['samples'] + 2} steps per point: predicted collectives' CPU {total:.3f} s; "
          f"gloo's threads (gloo_tcp_loop + pt_gloo_runloop) measured {', '.join(f'{g:.3f}' for g in gloo)} s per rank "
          f"(they also ran the two barriers of every step, which the prediction does not price)")


if __name__ == "__main__":
    main()
