# The measurements of docs/performance.md "What is left in the kernels on AMD Zen 4", from
# the repository root on a clean tree at 9169b6b: each patch is applied, measured and taken off again.
set -e
D=docs/bench/cpu-epyc-zen4-headroom
python tools/probes/wide_narrow_probe.py > $D/wide_narrow.txt
git apply $D/pair_prefetch.patch
for v in 0 -1 64 0 -1 64; do echo "DFLASH_PAIR_PF=$v"; DFLASH_PAIR_PF=$v python tools/probes/wide_narrow_probe.py --threads 1 --rows 1,4 | grep memory; done > $D/pair_prefetch_1thread.txt
for v in 0 64 0 64; do echo "DFLASH_PAIR_PF=$v"; DFLASH_PAIR_PF=$v python tools/probes/wide_narrow_probe.py --threads 2 --rows 1,2,4 | grep memory; done > $D/pair_prefetch_2threads.txt
DFLASH_PAIR_PF=64 python tools/kernel_ab.py HEAD --rows 6,8,16 --formats q4_0,q4_1,q8_0 --threads 2 --mb 96 > $D/pair_prefetch_kernel_ab.txt
for i in 1 2 3; do for v in 0 64; do echo "DFLASH_PAIR_PF=$v"; DFLASH_PAIR_PF=$v dflash profile --quantize auto --sizes 8,16 --no-draft --repeats 30 --json 2>/dev/null | tail -1; done; done > $D/pair_prefetch_profile.txt
git apply -R $D/pair_prefetch.patch
git apply $D/chain1.patch
for i in 1 2 3; do for v in 0 1; do DFLASH_CHAIN1=$v python $D/chain_rows.py; done; done > $D/chain1.txt
git apply -R $D/chain1.patch
git apply $D/split_transposed.patch
python tools/probes/attention_ab.py HEAD --starts 512,1008 --rows 2,4,8 --layers 30 --rounds 9 > $D/split_transposed.txt
git apply -R $D/split_transposed.patch
python $D/guess_replay.py 3 2 0.0 > $D/guess_replay.txt
python $D/guess_replay.py 3 2 0.3 >> $D/guess_replay.txt
echo done

# At 58705cc (prefetch_pair), against 9169b6b's kernels built beside them:
python tools/kernel_ab.py 9169b6b --rows 1,4,6,8,16 --formats q4_0,q4_1,q8_0 --threads 2 --mb 96 > $D/prefetch_pair_default_model.txt
python tools/kernel_ab.py 9169b6b --isa 2 --rows 1,6,8,16 --formats q4_0,q4_1,q8_0 --threads 2 --mb 96 \
    --shapes down,4096x4096,1536x4096,4096x1536 > $D/prefetch_pair_large_k.txt
# decode_threads.txt: perf record -e cpu-clock -F 4000 -p PID -- sleep 8 on tools/probes/steady_pass_probe.py --rows 1
# --quantize auto and on python $D/gen_loop.py 26, each 10-12 s after its start; perf report --sort pid,dso --stdio

# The split attention's prefetch, against 43a2648's attention files built beside it, and in the model against a worktree
# of 43a2648 with its own DFLASH_HOME (old and new in turn, four rounds):
python tools/probes/attention_ab.py 43a2648 --starts 300,512,700,1008,2032,4064 --rows 1,2,4,8 --layers 30 --rounds 9 > $D/attention_prefetch.txt
#   dflash profile --quantize auto --context 1000 --sizes 2,4 --no-draft --repeats 60 --json  -> attention_prefetch_profile.txt
# The split's scratch without zeroing, against a50e065:
python tools/probes/attention_ab.py a50e065 --starts 512,1008,2032,4064 --rows 1,2,4,8 --layers 30 --rounds 9 > $D/split_scratch.txt
# Switches read on every call, at f9b7a94 (apply, measure, take off; the output files hold the commands):
#   decode_split.patch:   python $D/switch_ab.py DFLASH_DSPLIT 512,128 130,200,300,400,500 40 > $D/decode_split.txt
#   tiles_prefetch.patch: python $D/switch_ab.py DFLASH_TPF 0,1 150,300,450 40 > $D/tiles_prefetch.txt
