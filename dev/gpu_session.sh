#!/bin/bash
# A GPU session's runs, in the background so that each `run` call can poll (a call lasts at
# most 10 minutes; the session has 30 of device time). Steps by name, in the order given:
#
#   run(command="PROTO_GIT_COMMIT=<12 hex> PROTO_GPU_SECONDS=<budget_left_s> setsid nohup \
#       bash dev/gpu_session.sh lane graph_memory sanitize > /dev/null 2>&1 & sleep 2; \
#       bash dev/gpu_session.sh poll 540")
#   run(command="bash dev/gpu_session.sh poll 540")          # again until "all done"
#   run(command="bash dev/gpu_session.sh left 900; bash dev/gpu_session.sh poll 540")
#                       # (the first reply's budget_left_s: the steps fit what is truly left)
#
# Steps: lane (the GPU tests, 9 processes, then the files that read memory alone: 11.5
# minutes on the H100 at c1693fa, about 8 since the isolation tests' children load no
# kernels), graph_memory (the memory figure, each method in its own process, about 8),
# sanitize (compute-sanitizer's four tools over the GPU tests, about 7), kernel_speed (every
# kernel against PyTorch's), gptj (GPT-J-6B in float16, all nine methods: about 25),
# wav2vec2 (an epoch of Wav2Vec2 training per method, all seven and the two checks: 12
# minutes on the H200; the first three alone took 12.5 on the H100 at c1693fa, before the
# capture's memory readings went from 119 to 24, under 9.6 at aa0562a).
# The same two in parts, `--methods`, for sessions too short for either whole: each part
# keeps the rows the others wrote at the same commit on the same card, so run every part at
# ONE commit (between sessions commit only results and notes); a ratio takes two methods of
# one part. gptj_step (ours_eager, ours_device, ptgraph_step: the step figures, about 4
# minutes on the H100 from 8441a32's setup_s and ms per token), gptj_memory
# (ours_per_length, ptgraph_shared: the memory figure, about 7), gptj_generate (ours_while,
# about a minute, and hf_generate, not yet timed at full size: transformers' generate
# against ours), gptj_rest (hf_compiled, held to 15 minutes, and ptgraph_private, about 3;
# no method of ours beside them, so their per-token ratios stay None); wav2vec2_head
# (ours_planned, hf_eager, ptgraph_shared: the summary's figures, under 9.6 minutes on the
# H100 at aa0562a), wav2vec2_checks (check_bits, check_loss: a few minutes),
# wav2vec2_rest (hf_amp, ours_eager, ptgraph_private, ours_unplanned: about 5, from the
# H200's whole run). end_to_end
# (GPT-2 beam search, float32 and float16, up to 25 minutes), and its parts by setup
# (`--setups`, kept and merged as the parts above): end_to_end_fp16 (GPT-2 small in float16,
# issue 56's gpt2_fp16_* figures: about 7 minutes, from the H200's 12L-d768 float32 rows at
# 392e11c3b414, an upper bound: 4 methods x 6 generations of 1020 tokens, 3.5 minutes with
# hf_generate's 60 s setup, then compiling, the model and the step's child) and
# end_to_end_fp32 (4L-d256 and 12L-d768 with PyTorch's methods and the WHILE profile: the 15
# minutes the whole run took before the float16 setup), half_decode (GPT-J's float16
# decode GEMMs over the trans_b kernel's geometries, against cuBLAS: dev/bench/bench_half_decode.py),
# half_attention (GPT-J's float16 decode attention, strided and grouped kernels against
# torch's scaled_dot_product_attention, about two minutes: dev/bench/bench_half_attention.py;
# half_attention_gpt2: GPT-2 small's, the packed group kernel's geometries), gpt2_half_profile
# (GPT-2 small's float16 step's kernels at 512 and the step over its floor, a minute or two:
# dev/probe/gpt2_half_profile.py), ab_half_step (that step as shipped against K split for qkv
# and fc, and against the strided float16 attention, in one process: dev/ab/ab_half_step.py,
# about 5 minutes), probes
# (the kernel cache's test, then where recording GPT-2 takes memory), w2v_profile (a Wav2Vec2
# training step's kernels, ours beside transformers', half a minute), gptj_profile (GPT-J's
# decode step's kernels at position 512, ours beside PtGraph's), train_gemm (Wav2Vec2's
# float32 GEMMs over the tiled kernel's tile shapes against cuBLAS: dev/bench/bench_train_gemm.py;
# train_gemm_mma: only the default and the tensor-core tiles, a few minutes less; tune: the
# same at 120, 199 and 65 frames (about 5 minutes, the table written after each), then
# conv_bench (tune_conv alone: that second part, a minute and a half), each writing its section of
# kernels/tuned/<gpu>.json, which the later steps of the session then run with: commit it
# with their results; gemm_ncu: Nsight Compute's
# counters for one launch of each GEMM tile, dev/probe/gemm_ncu.py, where ncu exists),
# conv_bench (Wav2Vec2's convolutions against cuDNN, the feature encoder's also on tensor
# cores: dev/bench/bench_conv1d.py, about a minute).
# The kernels load from Numba's cache after the first process compiles them: a fresh machine
# spends about a minute on that once. The steps run in a copy of the checkout,
# /tmp/gpu_session/tree, which later `run` calls leave alone. Each step's log is in
# /tmp/gpu_session/<step>.txt; poll tars them with the copy's results/ and figures/ into $OUT. Commit results only under the folder of the card that ran them.
set -u
L=/tmp/gpu_session
if [ "${1:-}" = left ]; then   # the device seconds left now, from a `run` reply's lease
  echo $(( $(date +%s) + $2 - 90 )) > $L/deadline; exit 0
fi
if [ "${1:-}" = poll ]; then
  end=$((SECONDS + ${2:-540}))
  while [ $SECONDS -lt $end ] && ! grep -q "all done" $L/steps.txt 2>/dev/null; do sleep 5; done
  cat $L/steps.txt 2>/dev/null
  tar czf $OUT/gpu_session.tgz $L/*.txt $L/tree/results $L/tree/figures $L/tree/kernels/tuned \
    2>/dev/null; ls -la $OUT
  exit 0
fi
rm -rf $L; mkdir -p $L/tree   # (a warm machine keeps the last session's)
# Run from a copy: a later `run` call copies the working tree again, deleting what a step
# writes under results/ and figures/ while it runs (the sanitizer's logs, open for writing).
cp -a . $L/tree/ && cd $L/tree
export PYTHONUNBUFFERED=1 PYTHONPATH=.
# The device time left: PROTO_GPU_SECONDS at the start (`status`' budget_left_s less a few
# minutes for the machine to come), corrected by `gpu_session.sh left <budget_left_s>` from a
# later call's reply. Each step's limit is cut to what is left, less 90 s for the last poll,
# and a step with under a minute left is skipped: the steps given first run whole, and a long
# last one (wav2vec2 writes its summary as each method ends) stops in time for its files to
# come back.
echo $(( $(date +%s) + ${PROTO_GPU_SECONDS:-100000} - 90 )) > $L/deadline
step() { local name=$1 secs=$2; shift 2
  local left=$(( $(cat $L/deadline) - $(date +%s) ))
  if [ $left -lt 60 ]; then
    echo "$(date -u +%T) skip $name ($left s of device time left)" >> $L/steps.txt; return; fi
  [ $secs -gt $left ] && secs=$left
  echo "$(date -u +%T) start $name (limit $secs s)" >> $L/steps.txt
  timeout -k 10 $secs "$@" > $L/$name.txt 2>&1
  local rc=$?   # (before the date's substitution, which resets $?)
  echo "$(date -u +%T) end $name rc=$rc" >> $L/steps.txt; }
# the host too: transformers' eager step is partly bound by its host's launches
{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.max.sm --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)|MHz"; uptime
  echo "commit ${PROTO_GIT_COMMIT:-unknown}"; } > $L/device.txt 2>&1
for s in "$@"; do case $s in
  probes)   # the first import compiles every kernel into the cache; the later ones load it
    step kernel_cache 300 python3 -m pytest -q tests/test_kernel_cache_gpu.py
    step parts 300 python3 dev/probe/graph_memory_parts.py 96
    step bisect 300 python3 -m dev.probe.graph_memory_bisect 128 ;;
  graph_memory) step graph_memory 1500 python3 -m experiments graph_memory --size full ;;
  lane) step lane 900 python3 -m tests.gpu_lane ;;
  kernel_speed) step kernel_speed 900 python3 -m experiments kernel_speed --size full ;;
  gptj) step gptj 1500 python3 -m experiments gptj --size full ;;
  gptj_step) step gptj_step 480 python3 -m experiments gptj --size full \
      --methods ours_eager,ours_device,ptgraph_step ;;
  gptj_memory) step gptj_memory 720 python3 -m experiments gptj --size full \
      --methods ours_per_length,ptgraph_shared ;;
  gptj_generate) step gptj_generate 720 python3 -m experiments gptj --size full \
      --methods ours_while,hf_generate ;;
  gptj_rest) step gptj_rest 1320 python3 -m experiments gptj --size full \
      --methods hf_compiled,ptgraph_private ;;
  end_to_end) step end_to_end 1500 python3 -m experiments end_to_end --size full ;;
  end_to_end_fp16) step end_to_end_fp16 600 python3 -m experiments end_to_end --size full \
      --setups 12L-d768-fp16 ;;
  end_to_end_fp32) step end_to_end_fp32 1200 python3 -m experiments end_to_end --size full \
      --setups 4L-d256,12L-d768 ;;
  half_decode) step half_decode 600 env OUT=$L python3 -m dev.bench.bench_half_decode ;;
  half_attention) step half_attention 300 python3 -m dev.bench.bench_half_attention ;;
  half_attention_gpt2) step half_attention_gpt2 300 python3 -m dev.bench.bench_half_attention \
      --model gpt2 ;;
  gpt2_half_profile) step gpt2_half_profile 300 python3 -m dev.probe.gpt2_half_profile ;;
  ab_half_step) step ab_half_step 480 python3 -m dev.ab.ab_half_step ;;
  wav2vec2) step wav2vec2 1500 python3 -m experiments wav2vec2_train --size full ;;
  wav2vec2_head) step wav2vec2_head 660 python3 -m experiments wav2vec2_train --size full \
      --methods ours_planned,hf_eager,ptgraph_shared ;;
  wav2vec2_checks) step wav2vec2_checks 420 python3 -m experiments wav2vec2_train \
      --size full --methods check_bits,check_loss ;;
  wav2vec2_rest) step wav2vec2_rest 900 python3 -m experiments wav2vec2_train --size full \
      --methods hf_amp,ours_eager,ptgraph_private,ours_unplanned ;;
  w2v_profile) step w2v_profile 600 python3 -m dev.probe.wav2vec2_profile ;;
  gptj_profile) step gptj_profile 600 python3 -m dev.probe.gptj_profile ;;
  train_gemm) step train_gemm 600 python3 -m dev.bench.bench_train_gemm ;;
  train_gemm_mma) step train_gemm_mma 600 python3 -m dev.bench.bench_train_gemm 120 --mma ;;
  tune) step tune 600 python3 -m dev.bench.bench_train_gemm 120 199 65 --mma --write ;&
  tune_conv) step tune_conv 300 python3 -m dev.bench.bench_conv1d --write ;;   # (tune too)
  gemm_ncu)   # Nsight Compute's counters for the GEMM tiles, where the machine has ncu
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu \
          2>/dev/null | head -1)
    if [ -n "$NCU" ]; then
      step gemm_ncu 300 $NCU --section SpeedOfLight --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
        -k regex:gemm_tiled python3 -m dev.probe.gemm_ncu
    else echo "no ncu on this machine" > $L/gemm_ncu.txt; fi ;;
  conv_bench) step conv_bench 600 python3 -m dev.bench.bench_conv1d ;;
  sanitize) step sanitize 900 python3 -m tests.sanitize ;;
  *) echo "unknown step $s" >> $L/steps.txt ;;
esac; done
echo "$(date -u +%T) all done" >> $L/steps.txt
