#!/bin/bash
# the trial build: wide_trial.patch applied at 23135bb; DFLASH_EXP_WIDE=1 keeps the down projection (k >= 1024) on the
# 512-bit path from 6 rows, 2 the LM head (n >= 16384), 3 both, 0 neither (the 23135bb dispatch); fresh processes, alternating.
# AMD EPYC Zen 4 (family 25 model 17), 2 cores, nothing else running. Output: wide_trial.txt
for round in 1 2 3; do
  for q in q4_0 auto; do
    for v in 0 1 2 3; do
      DFLASH_EXP_WIDE=$v dflash profile --quantize $q --sizes 4,6,8,12,16 --repeats 30 --json 2>/dev/null | tail -1 \
        | python -c "
import json,sys; d=json.load(sys.stdin); dec=d['decode_s']
print('round $round $q wide=$v decode %.2f ms; ' % (dec*1e3) + ' '.join('%s:%.2f' % (k, v*1e3) for k, v in d['verify_s'].items()), flush=True)"
    done
  done
done
