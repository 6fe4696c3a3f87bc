#!/bin/bash
# (issue 28, pass 8) System-wide perf profile of the harness's timed loop only: the harness (rank 0) touches
# $MARK when the loop starts; perf records every CPU for SECS seconds from then. Usage, from the repository root:
#   K=16000 STEPS=400 RING=0 bash docs/ina_live/pass8/profile/perf_window.sh out.data [PYTHONPATH]
set -e
out=$1; pp=${2:-.}
mark=$(mktemp -u /tmp/p8mark.XXXX)
MARK=$mark PYTHONPATH=$pp python docs/ina_live/pass8/profile/harness.py > $out.log 2>&1 &
hp=$!
while [ ! -e $mark ]; do sleep 0.05; done
perf record -a -F 4999 -o $out -- sleep ${SECS:-3} 2> /dev/null
wait $hp
rm -f $mark
