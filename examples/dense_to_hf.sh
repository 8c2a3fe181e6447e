#!/usr/bin/env bash
# Train a small dense GPT-2 (--num-experts 0: no MoE layer, which GPT2LMHeadModel could not hold)
# on the bundled sample corpus, export it to a Hugging Face directory and generate from it with
# transformers. About two minutes on 2 CPU cores; run it from the repository root:
#
#   bash examples/dense_to_hf.sh                          # -> runs/dense-hf/{ckpt,hf}
#   OUT=/tmp/dense TRAIN_ITERS=20 bash examples/dense_to_hf.sh --lr 1e-3
#
# OUT (default runs/dense-hf, git-ignored) must not exist: the checkpoint goes to OUT/ckpt and the
# export to OUT/hf. Extra arguments go to the trainer (not the flags given below).
set -euo pipefail

OUT=${OUT:-runs/dense-hf}
TRAIN_ITERS=${TRAIN_ITERS:-300}
if [[ -e $OUT ]]; then
    echo "dense_to_hf.sh: $OUT exists: remove it or set OUT" >&2
    exit 2
fi

mmoe-pretrain --num-experts 0 --train-iters "$TRAIN_ITERS" --save "$OUT/ckpt" "$@"
mmoe-convert export-hf --load "$OUT/ckpt" --output "$OUT/hf" --verify
python - "$OUT/hf" <<'PY'
import sys
from transformers import AutoTokenizer, GPT2LMHeadModel

model, tok = GPT2LMHeadModel.from_pretrained(sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[1])
ids = tok(" = Valkyria = \n", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=tok.eos_token_id)
print(repr(tok.decode(out[0])))
PY
