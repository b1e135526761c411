#!/usr/bin/env bash
# The block kernels' measurements of docs/performance.md ("Block kernels"), one after the other on an
# otherwise idle machine: the profile's verify/decode ratios, where a verify pass's time goes, the
# per-shape kernel table beside PyTorch's int4 kernel and llama.cpp's batch scaling, the bench against
# llama.cpp, and the NLL table.
#   bash tools/measure_kernels.sh OUT_DIR
set -euo pipefail
out=${1:?usage: bash tools/measure_kernels.sh OUT_DIR}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
dflash=${DFLASH:-.venv/bin/dflash}
$py -c "import torch; print('cpu capability', torch.backends.cpu.get_cpu_capability()); from dflash_torch import kernels; print('kernels', kernels.best_isa())" | tee "$out/cpu.txt"
grep -m1 "model name" /proc/cpuinfo | tee -a "$out/cpu.txt"
# the vector ports under the VNNI loop (AVX-512 VNNI CPUs only; elsewhere it says why and the rest runs)
$py tools/probes/zmm_ports_probe.py > "$out/zmm_ports.txt" 2>&1 || true
for q in q4_0 q4_1 int4; do
  $dflash profile --quantize $q --repeats 20 --json > "$out/profile-$q.txt" 2>&1
  tail -1 "$out/profile-$q.txt"
done
# where a verify pass's time goes (the heaviest operators at 1, 4 and 16 rows)
$py tools/probes/verify_ops_probe.py --rows 1,4,16 > "$out/verify_ops.txt" 2>&1
# PEER=0: without llama.cpp (a llama-cpp-python built for another CPU dies of an illegal instruction)
peer=${PEER:-1}
$py tools/kernel_table.py --threads 2 --json "$out/kernel_table.json" $([ "$peer" = 1 ] || echo --no-llamacpp) \
  > "$out/kernel_table.txt" 2>&1
tail -40 "$out/kernel_table.txt"
$dflash bench --suite all --limit 1 --max-tokens 512,1024 --repeats 1 --ignore-eos --fallback --adaptive \
  --quantize auto $([ "$peer" = 1 ] && echo --peer llamacpp --peer-interleave) --out "$out/bench" --json \
  > "$out/bench.txt" 2>&1
tail -20 "$out/bench.txt"
$py tools/activation_nll.py --texts 50 --tokens 256 --formats none,auto,q8_0,q4_0,int4 > "$out/nll.txt" 2>&1
tail -8 "$out/nll.txt"
