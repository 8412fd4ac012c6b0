#!/bin/bash
# The next GPU session's runs, in the order they matter, in the background so that each
# `run` call can poll (a call lasts at most 10 minutes; the session has 30 of device time):
#
#   run(carry=[], command="PROTO_GIT_COMMIT=<12 hex> setsid nohup bash dev/gpu_session.sh \
#       > /dev/null 2>&1 & sleep 2; bash dev/gpu_session.sh poll 540")
#   run(command="bash dev/gpu_session.sh poll 540")          # again until "all done"
#
# Each step's log is in /tmp/gpu_session/<step>.txt; poll tars them with results/ and
# figures/ into $OUT. Commit results only under the folder of the card that ran them.
set -u
L=/tmp/gpu_session
if [ "${1:-}" = poll ]; then
  end=$((SECONDS + ${2:-540}))
  while [ $SECONDS -lt $end ] && ! grep -q "all done" $L/steps.txt 2>/dev/null; do sleep 5; done
  cat $L/steps.txt 2>/dev/null
  tar czf $OUT/gpu_session.tgz $L results figures 2>/dev/null; ls -la $OUT
  exit 0
fi
mkdir -p $L
export PYTHONUNBUFFERED=1 PYTHONPATH=.
step() { local name=$1 secs=$2; shift 2
  echo "$(date -u +%T) start $name" >> $L/steps.txt
  timeout -k 10 $secs "$@" > $L/$name.txt 2>&1
  echo "$(date -u +%T) end $name rc=$?" >> $L/steps.txt; }
{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
  echo "commit ${PROTO_GIT_COMMIT:-unknown}"; } > $L/device.txt 2>&1
# 1. which launcher's recording takes the unexplained memory (about 2 minutes)
step bisect 300 python3 -m dev.probe.graph_memory_bisect 128
# 2. the memory figure, each method in its own process (about 15 minutes: a child compiles
#    the kernels, about a minute, before it measures)
step graph_memory 1500 python3 -m experiments graph_memory --size full
# 3. the GPU test lane at the same commit (about 10 minutes)
step lane 900 python3 -m tests.gpu_lane
echo "$(date -u +%T) all done" >> $L/steps.txt
