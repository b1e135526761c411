#!/bin/bash
# Alternating fresh `dflash profile` processes with DFLASH_VNNI_MIN_ROWS=1/5/9 (9: the Zen 4 default since e9aff82),
# at 5e24c37 (the 512-bit path's broadcasts inside dpbusd, whole tiles stored straight to the output). AMD EPYC Zen 4
# (family 25 model 17), 2 cores, nothing else running. Output: ms per pass, in parentheses decode steps.
for round in 1 2 3; do
  for q in q4_0 auto; do
    for v in 1 5 9; do
      DFLASH_VNNI_MIN_ROWS=$v .venv/bin/dflash profile --quantize $q --sizes 2,4,8 --repeats 40 --json 2>/dev/null | tail -1 \
        | .venv/bin/python -c "
import json,sys; d=json.load(sys.stdin); dec=d['decode_s']
print('round $round $q min_rows=$v decode %.2f ms; ' % (dec*1e3) + ' '.join('%s:%.2f(%.2f)' % (k, v*1e3, v/dec) for k, v in d['verify_s'].items()) + ' draft ' + ' '.join('%s:%.2f' % (k, v*1e3) for k, v in d['draft_s'].items()), flush=True)"
    done
  done
done
