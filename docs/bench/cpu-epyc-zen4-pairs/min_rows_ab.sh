#!/bin/bash
# (at 06de908 with the 512-bit pairs prefetched in address order, the build committed with vnni_min_rows 9)
# Alternating fresh `dflash profile` processes with DFLASH_VNNI_MIN_ROWS=9/13/17 (17: the Zen 4 default), the
# 512-bit path's pairs prefetched in address order. AMD EPYC Zen 4 (family 25 model 17), 2 cores.
for round in 1 2 3; do
  for q in q4_0 auto; do
    for v in 9 13 17; do
      DFLASH_VNNI_MIN_ROWS=$v .venv/bin/dflash profile --quantize $q --sizes 2,4,8,12,16 --repeats 30 --json 2>/dev/null | tail -1 \
        | .venv/bin/python -c "
import json,sys; d=json.load(sys.stdin); dec=d['decode_s']
print('round $round $q min_rows=$v decode %.2f ms; ' % (dec*1e3) + ' '.join('%s:%.2f(%.2f)' % (k, v*1e3, v/dec) for k, v in d['verify_s'].items()), flush=True)"
    done
  done
done
