#!/usr/bin/env bash
# Nsight Compute profile of jequi's kernels (device tool, Firecracker machines; ncu is
# told to leave the clocks alone). From the repo root, .peers carried:
#   bash benchmarks/profile_conv.sh TAG [tune_conv.py args, e.g. --channel-windows 1,2]
# SCRIPT picks another driver in benchmarks/ (profile_cuda.py for the CUDA kernels, with
# KERNEL=jequi_ LAUNCHES=8 and its --repeat 1 --calls 1), LAUNCHES the launches profiled.
# profiles the first two launches of kernels matching KERNEL (a regex, default jequi_conv,
# which tune_conv.py's order makes the conv forward's first two launches: KERNEL=jequi_conv_bwd
# for the backward, jequi_tp_fwd with --no-conv --tp-batch N for the batched forward) in
# tune_conv.py's first setting and writes $OUT/TAG.ncu-rep and $OUT/TAG.txt (the details
# page), then prints the headline metrics. The raw page is only printed, and the driver's log
# is kept only if ncu wrote no report: two files a tag, since the device tool returns at most
# eight files a call.
set -uo pipefail
tag=$1; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
sections=(SpeedOfLight LaunchStats Occupancy WarpStateStats SchedulerStats MemoryWorkloadAnalysis
          ComputeWorkloadAnalysis InstructionStats SourceCounters)
kernel=${KERNEL:-jequi_conv}
cd benchmarks
timeout "${PROFILE_TIMEOUT:-240}" ncu --clock-control none --kernel-name "regex:$kernel" --launch-count "${LAUNCHES:-2}" \
  "${sections[@]/#/--section=}" -f -o "$OUT/$tag" python3 "${SCRIPT:-tune_conv.py}" "$@" > "$OUT/$tag.run.log" 2>&1
if [ -f "$OUT/$tag.ncu-rep" ]; then rm "$OUT/$tag.run.log"; else tail -20 "$OUT/$tag.run.log"; fi
ncu --import "$OUT/$tag.ncu-rep" --page details > "$OUT/$tag.txt" 2>&1
grep -E "$kernel|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Local Memory|Executed Ipc A|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Block Limit Reg|Stall|Shared Memory Configuration Size|Dynamic Shared" "$OUT/$tag.txt" | head -80
ncu --import "$OUT/$tag.ncu-rep" --page raw 2>&1 | grep -E "$kernel|smsp__average_warps_issue_stalled_.*_per_issue_active.ratio|launch__registers_per_thread|l1tex__t_bytes_pipe_lsu_mem_local|smsp__inst_executed.sum |sm__throughput.avg.pct|dram__bytes_read.sum |dram__bytes_write.sum |l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum |l1tex__t_requests_pipe_lsu_mem_global_op_st.sum |l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum |l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum |lts__t_sectors_op_write.sum |lts__t_sectors_op_read.sum " \
  | awk -v k="$kernel" '{ if ($0 ~ k || $NF+0 > 0.05 || $0 !~ /stalled/) print }' | head -80
