#!/usr/bin/env bash
# Llama-3-8B-style GPT on one node with 8 GPUs: TP=8 + sequence parallelism, with the
# TP communication overlapped by megatron-overlap. Mock data, so no dataset or tokenizer needed.
#
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/llama3_8b_tp8_torchrun.sh
#
# On several nodes, run it on each with NNODES, NODE_RANK and MASTER_ADDR (the first node's
# address) set; TP stays inside a node, DP = NNODES x GPUS_PER_NODE / TP.
#
# Extra arguments are passed on to pretrain_gpt.py (after the ones below, so they win).
set -euo pipefail

MEGATRON_LM=${MEGATRON_LM:-$HOME/Megatron-LM}   # checkout holding pretrain_gpt.py
CHECKPOINT=${CHECKPOINT:-}                      # optional: save/load checkpoints here
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TP=${TP:-8}
SEQ_LENGTH=${SEQ_LENGTH:-8192}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-16}
TRAIN_ITERS=${TRAIN_ITERS:-100}
MASTER_PORT=${MASTER_PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-localhost}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}

# Megatron requires this with TP > 1 (before Blackwell): kernels run in the order they are launched.
export CUDA_DEVICE_MAX_CONNECTIONS=1

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope
    --rotary-base 500000
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --sequence-parallel
    --transformer-impl local
)

# --overlap-tp-chunks 0: the plugin picks the chunk count; --overlap-tp-rs ring: ring reduce-scatter.
OVERLAP_ARGS=(
    --overlap-tp p2p
    --overlap-tp-chunks 0
    --overlap-tp-rs ring
)

TRAINING_ARGS=(
    --micro-batch-size "$MICRO_BATCH"
    --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS"
    --bf16
    --lr 3.0e-4
    --min-lr 3.0e-5
    --lr-decay-style cosine
    --lr-warmup-iters 10
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --init-method-std 0.02
    --recompute-activations
)

DATA_ARGS=(
    --mock-data
    --tokenizer-type NullTokenizer
    --vocab-size 128256
)

LOGGING_ARGS=(
    --log-interval 1
    --eval-iters 0
    --eval-interval 1000  # Megatron-LM needs one even without evaluation
)
if [[ -n "$CHECKPOINT" ]]; then
    LOGGING_ARGS+=(--save "$CHECKPOINT" --load "$CHECKPOINT" --save-interval 1000)
fi

# --no-python: torchrun starts the megatron-overlap launcher, which runs pretrain_gpt.py.
torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    --no-python megatron-overlap run "$MEGATRON_LM/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" "${OVERLAP_ARGS[@]}" "$@"
