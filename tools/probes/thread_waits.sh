#!/bin/bash
# Where a steady loop of passes spends each thread's time: the dflash kernels, everything else outside
# libgomp (torch, Python, libc), and libgomp's two spin loops: the one where a thread waits to be handed a
# parallel region ("dock") and the one at a region's barrier. The two loops are told apart by their
# offsets in the libgomp that torch 2.13.0's CPU wheel bundles (0x1de60-0x1de6f and 0x1e028-0x1e03f,
# from `objdump -d` of it); another libgomp needs its own.
#
#     bash tools/probes/thread_waits.sh ROWS [QUANTIZE]      (perf must be installed)
set -e
R=${1:-1}; Q=${2:-q4_0}; OUT=$(mktemp -d)
python tools/probes/steady_pass_probe.py --rows "$R" --seconds 30 --quantize "$Q" > "$OUT/pass.txt" 2>&1 &
P=$!
sleep 12  # the model loaded, the loop running
perf record -e cpu-clock -F 4000 -p $P -o "$OUT/perf.data" -- sleep 8 > /dev/null 2>&1
wait $P
tail -1 "$OUT/pass.txt"
perf script -i "$OUT/perf.data" -F tid,ip,sym,dso -G 2>/dev/null | awk '{
  tid = $1; a = substr($2, length($2) - 4); lib = $NF
  if (lib ~ /libgomp/) { if (a ~ /^1de6/) k = "gomp: dock (no region)"; else if (a ~ /^1e0[23]/) k = "gomp: barrier"; else k = "gomp: other" }
  else if (lib ~ /dflash_blocks/) k = "dflash kernels"; else k = "other (torch, python, libc)"
  n[tid]++; c[tid " | " k]++ } END { for (x in c) { split(x, p, " \\| "); printf "%s %5.1f%%  %s\n", p[1], 100 * c[x] / n[p[1]], p[2] } }' | sort
rm -rf "$OUT"
