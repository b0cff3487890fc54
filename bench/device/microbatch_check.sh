#!/bin/bash
# Does the loss curve depend on how the global batch is split into micro-batches? It must not: one
# global batch of 16 sequences, the same data and init, trained through pretrain_galaxy.py at
# num_microbatches 16 and 4 (and eager against compiled) must give the same losses and grad norms up to
# bf16 rounding. A 7B launch at 88355ac gave grad norm 0.60 at 16 micro-batches and 5.98 at 4 (step 1).
#   bash bench/device/microbatch_check.sh [WORLD] [LAYERS] [HIDDEN]      (on the GPU machine; ~1 min a run)
set -o pipefail
world=${1:-2}; layers=${2:-2}; hidden=${3:-1024}; device=${DEVICE:-auto}; seq=${SEQ:-4096}
out=${OUT:-/tmp}/microbatch_check; mkdir -p "$out"
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for compile in ${COMPILES:-false true}; do
    for nm in ${MICROBATCHES:-16 4}; do
        name=compile_${compile}_mb$nm
        cat > "$out/$name.config.json" <<JSON
{"model": {"preset": "llama-7b", "num_hidden_layers": $layers, "hidden_size": $hidden,
           "intermediate_size": $((hidden * 43 / 16)), "num_attention_heads": 8, "num_key_value_heads": 8,
           "compile": $compile},
 "parallel": {"plan": "galaxy", "mp_grad_reduce": "sharded", "num_microbatches": $nm},
 "train": {"global_batch_size": 16, "seq_length": $seq, "dtype": "bfloat16", "device": "$device"}}
JSON
        rm -f "$out/$name.jsonl"
        timeout "${RUN_S:-240}" python3 pretrain_galaxy.py --config "$out/$name.config.json" --world "$world" \
            --max_steps 3 --metrics_file "$out/$name.jsonl" --no_progress > "$out/$name.log" 2>&1 \
            || { echo "$name: failed: $(tail -1 "$out/$name.log")"; continue; }
        python3 -c "
import json
rows = [json.loads(l) for l in open('$out/$name.jsonl')]
print('$name', ' '.join(f\"step {r['step']}: loss {r['loss']:.5f} grad_norm {r['grad_norm']:.5f} ({r['step_time_s']:.2f} s)\" for r in rows))"
    done
done
