#!/bin/bash
# Alternating processes, each a fresh `dflash profile` (the row threshold is read once per process), at ecf20b3:
# 6 was the default there, 17 is the default since 23135bb. AMD EPYC Zen 4 (family 25 model 17), 2 cores, nothing
# else running. Output: min_rows_ab.txt
for round in 1 2 3 4; do
  for q in q4_0 auto; do
    for v in 6 9 17; do
      DFLASH_VNNI_MIN_ROWS=$v dflash profile --quantize $q --sizes 2,4,6,8,12,16 --repeats 30 --json 2>/dev/null | tail -1 \
        | python -c "
import json,sys; d=json.load(sys.stdin); dec=d['decode_s']
print('round $round $q min_rows=$v decode %.2f ms; ' % (dec*1e3) + ' '.join('%s:%.2f' % (k, v*1e3) for k, v in d['verify_s'].items()), flush=True)"
    done
  done
done
