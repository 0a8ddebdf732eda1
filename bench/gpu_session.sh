#!/usr/bin/env bash
# One lease of a lent GPU machine, in stages: `check` (the CUDA paths at smoke sizes, the GPU test
# tier, the launch-bound benchmark), then `gpt2` and `resnet50` (one full benchmark each, minutes),
# `gpt2-torch-dropout` (gpt2 with phalanx drawing torch's dropout: per_sample_random false),
# `tier` (the GPU test tier on five pytest workers, about 2 minutes), `dropout` (bench/keyed_dropout.py
# on a GPT-2-small block's shape, then 12 such blocks compiled, two to four minutes), `lease` (what a short lease
# must see first, in one call of about 4 minutes: the tier, `phalanx plan` on the GPU, the
# launch-bound benchmark),
# `bisect` (the launch-bound benchmark at each older source carried in .old/COMMIT, then at this
# tree, in one call: each with its own bench/gpu.py, its ratios against its own hand loop; make
# them with `mkdir -p .old/C && git archive C src bench examples | tar -x -C .old/C` and carry
# `.old`), `trace` (bench/gpu_trace.py at each of those sources and at this tree, about 30 s each:
# what a launch-bound step asks of the GPU and of the host), and `largest-plain`, `largest-checkpointed`, `largest-fsdp-offload`
# (bench/largest_model.py's search, one mode each; LARGEST_ARGS such as "--start 16" start it
# nearer the answer).
# Run from the repository root; logs and JSON go to $OUT (or bench/results/gpu-session).
# The machines lack pydantic: carry its wheels in .whl (see BENCHMARKS.md).
set -uo pipefail
shopt -s nullglob  # bisect and trace without .old: the tree alone
OUT=${OUT:-bench/results/gpu-session}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
SITE=
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" || exit 1
    SITE=/tmp/site:
fi
ROOT=$PWD
export PYTHONPATH=$SITE$PWD/src:$PWD
export PYTHONUNBUFFERED=1
for stage in "$@"; do
    case $stage in
    check)
        { nvidia-smi; python3 -c "import torch, sys; print(sys.version, torch.__version__, torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/machine.txt"
        for w in gpt2-small resnet50 launch-bound; do
            timeout 300 python3 bench/gpu.py --workload "$w" --smoke --device cuda --out "/tmp/smoke-$w.json" 2>&1 | tail -n 12
        done > "$OUT/smoke.log"
        tail -n 40 "$OUT/smoke.log"
        timeout 500 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/tests-gpu.log" | tail -n 30
        timeout 300 python3 bench/gpu.py --workload launch-bound --out "$OUT/gpu-launch-bound.json" 2>&1 | tee "$OUT/launch-bound.log" | tail -n 20
        ;;
    lease|tier)
        { nvidia-smi; python3 -c "import torch, sys; print(sys.version, torch.__version__, torch.cuda.get_device_name())"; nproc; } 2>&1 | tee "$OUT/machine.txt"
        timeout -k 5 270 python3 -m pytest -q -p no:cacheprovider -n 5 --durations=0 tests/gpu 2>&1 | tee "$OUT/tests-gpu.log" | tail -n 30
        [ "$stage" = tier ] && continue
        for example in digits two_tower; do  # one GPU here: four machines like it, joined by HDR
            COLUMNS=160 timeout -k 5 60 python3 -m phalanx.cli plan "examples/$example/config.yaml" --nnodes 4 --link infiniband-hdr --output "$OUT/plan-$example.json" 2>&1 | tee "$OUT/plan-$example.log" | tail -n 12
        done
        timeout -k 5 110 python3 bench/gpu.py --workload launch-bound --out "$OUT/gpu-launch-bound.json" 2>&1 | tee "$OUT/launch-bound.log" | tail -n 20
        ;;
    dropout)
        timeout -k 5 200 python3 bench/keyed_dropout.py --device cuda --batch 32 --seq 1024 --width 768 --rounds 5 --out "$OUT/keyed-dropout.json" 2>&1 | tee "$OUT/keyed-dropout.log" | tail -n 5
        # GPT-2-small's 24 block dropouts (each site its own keys), both stacks compiled
        timeout -k 5 300 python3 bench/keyed_dropout.py --device cuda --batch 32 --seq 1024 --width 768 --blocks 12 --compile --rounds 5 --out "$OUT/keyed-dropout-12-compiled.json" 2>&1 | tee "$OUT/keyed-dropout-12-compiled.log" | tail -n 5
        ;;
    gpt2-torch-dropout)  # phalanx with per_sample_random: false: the per-sample masks' cost apart
        timeout 570 python3 bench/gpu.py --workload gpt2-small --torch-dropout ${BENCH_ARGS:-} --out "$OUT/gpu-gpt2-small-torch-dropout.json" 2>&1 | tee "$OUT/gpt2-torch-dropout.log" | tail -n 25
        ;;
    gpt2|resnet50|launch-bound)
        w=$stage; [ "$w" = gpt2 ] && w=gpt2-small
        timeout 570 python3 bench/gpu.py --workload "$w" ${BENCH_ARGS:-} --out "$OUT/gpu-$w.json" 2>&1 | tee "$OUT/$w.log" | tail -n 25
        ;;
    bisect)
        for dir in .old/*/ ./; do
            name=$(basename "$dir"); [ "$dir" = ./ ] && name=head
            (cd "$dir" && PYTHONPATH=$SITE$PWD/src:$PWD timeout -k 5 170 python3 bench/gpu.py --workload launch-bound ${BENCH_ARGS:-} --out "$OUT/gpu-launch-bound-$name.json") 2>&1 | tee "$OUT/launch-bound-$name.log" | tail -n 8
        done
        ;;
    trace)
        for dir in .old/*/ ./; do
            name=$(basename "$dir"); [ "$dir" = ./ ] && name=head
            if (cd "$dir" && PYTHONPATH=$SITE$PWD/src:$PWD timeout -k 5 90 python3 "$ROOT/bench/gpu_trace.py" --label "$name") > "$OUT/trace-$name.log" 2>&1; then
                grep -A12 "phalanx:" "$OUT/trace-$name.log" | head -n 13
            else
                echo "trace at $name failed:"; tail -n 30 "$OUT/trace-$name.log"
            fi
        done
        ;;
    largest-plain|largest-checkpointed|largest-fsdp-offload)
        timeout 580 python3 bench/largest_model.py --mode "${stage#largest-}" ${LARGEST_ARGS:-} --out "$OUT/gpu-$stage.json" 2>&1 | tee "$OUT/$stage.log" | tail -n 25
        ;;
    *) echo "unknown stage $stage; stages: check tier dropout lease gpt2 gpt2-torch-dropout resnet50 launch-bound bisect trace largest-plain largest-checkpointed largest-fsdp-offload" >&2; exit 2 ;;
    esac
done
