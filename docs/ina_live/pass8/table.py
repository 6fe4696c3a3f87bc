"""(issue 28, pass 8) The paired table of docs/ina.md's eighth pass from the runs' JSON files:
python docs/ina_live/pass8/table.py [run numbers...] (default: every runN folder here)."""
import glob, json, os, re, sys
here = os.path.dirname(os.path.abspath(__file__))
runs = sorted(int(m.group(1)) for p in glob.glob(f"{here}/run*") if (m := re.match(r".*/run(\d+)$", p)))
runs = [int(a) for a in sys.argv[1:]] or runs
cols = [(k, p) for k in (2048, 8192, 16000) for p in (64, 512)]
print("| sync / ring (CPU / ring) | ring sync, CPU (ms) | " + " | ".join(f"{k:,} p{p}" for k, p in cols) + " |")
print("| --- " * (2 + len(cols)) + "|")
summary = []
for m in ("tiny", "small"):
    for r in runs:
        log = open(f"{here}/window.log").read() if os.path.exists(f"{here}/window.log") else ""
        first = "pass8" if r % 2 else "before"
        for tree in ((m, f"before_{m}") if first == "pass8" else (f"before_{m}", m)):
            f = f"{here}/run{r}/{tree}/live_sync.json"
            if not os.path.exists(f):
                continue
            d = json.load(open(f))
            rows = {x["mode"]: x for x in d["rows"]}
            ring = rows["ring"]
            cell = {c: rows.get(f"switchml_shm-{c[0]}-p{c[1]}") for c in cols}
            best = min((c for c in cols if cell[c]), key=lambda c: cell[c]["sync_vs_ring"])
            b2 = min((c for c in cols if c[0] == 2048 and cell[c]), key=lambda c: cell[c]["sync_vs_ring"])
            name = f"{m}, {'pass 8' if tree == m else 'before'}, run {r}"
            rel = os.path.relpath(f, os.path.join(here, "..", ".."))
            txt = []
            for c in cols:
                x = cell[c]
                s = f"{x['sync_vs_ring']:.2f}"
                if c in (best, b2):
                    s = f"**{s}**"
                txt.append(f"{s} ({x['cpu_vs_ring']:.2f})")
            print(f"| {name} ([json]({rel})) | {ring['sync_ms']:.1f}, {ring['cpu_ms']:.1f} | " + " | ".join(txt) + " |")
            summary.append((m, r, "pass8" if tree == m else "before", cell[best]["sync_vs_ring"], cell[b2]["sync_vs_ring"],
                            min(cell[c]["cpu_ms"] for c in cols if cell[c])))
print()
for s in summary:
    print(f"{s[0]:5s} run {s[1]} {s[2]:6s} best {s[3]:.2f}  2048 {s[4]:.2f}  "
          f"{'both targets' if s[3] <= 0.8 and s[4] <= 1.0 else 'best only' if s[3] <= 0.8 else '2048 only' if s[4] <= 1.0 else 'neither'}"
          f"  (lowest CPU a sync {s[5]:.1f} ms)")
