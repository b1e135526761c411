#!/usr/bin/env bash
# alternating fresh processes: by columns (DFLASH_ROWS_BY_THREAD=0) against the default, the issue's profile
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
for round in 1 2 3; do
  for v in 0 default; do
    if [ "$v" = 0 ]; then export DFLASH_ROWS_BY_THREAD=0; else unset DFLASH_ROWS_BY_THREAD; fi
    echo "round $round DFLASH_ROWS_BY_THREAD=$v"
    .venv/bin/dflash profile --quantize q4_0 --sizes 2,4,8,12,16 --repeats 40 --json 2>/dev/null | tail -1
  done
done
