#!/bin/bash
# Alternating fresh `dflash profile` processes of two checkouts, each with its own DFLASH_HOME (its own kernel
# build; the converted model linked in from the usual cache). Usage: profile_ab.sh OLD_TREE OLD_HOME NEW_TREE
# NEW_HOME ROUNDS. Here: OLD = a worktree at 9518c61, NEW = the checkout at 5e24c37, 3 rounds, AMD EPYC
# Zen 4 (family 25 model 17), 2 cores, nothing else running. Output: profile_ab.txt (ms per pass, in parentheses
# decode steps).
OLD=$1; OLDHOME=$2; NEW=$3; NEWHOME=$4; ROUNDS=${5:-3}
PY=${PY:-python}
for round in $(seq 1 $ROUNDS); do
  for q in q4_0; do
    for side in old new; do
      if [ $side = old ]; then dir=$OLD; home=$OLDHOME; else dir=$NEW; home=$NEWHOME; fi
      (cd $dir && DFLASH_HOME=$home $PY -m dflash_torch.cli profile --quantize $q --sizes 4,9,16 --repeats 40 --json 2>/dev/null | tail -1 \
        | $PY -c "
import json,sys; d=json.load(sys.stdin); dec=d['decode_s']
print('round $round $q $side decode %.2f ms; ' % (dec*1e3) + ' '.join('%s:%.2f(%.2f)' % (k, v*1e3, v/dec) for k, v in d['verify_s'].items()) + ' draft ' + ' '.join('%s:%.2f' % (k, v*1e3) for k, v in d['draft_s'].items()), flush=True)")
    done
  done
done
