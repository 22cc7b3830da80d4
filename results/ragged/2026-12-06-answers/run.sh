#!/bin/sh
# Left-padded batches of different prompts against each prompt alone: 8 batches x 4 chat needle prompts, four caches.
# From the repository root, on the code this ran on (commit 2656626; generate.py, tools/tasks.py at the root and in
# tools/). About 50 min on 2 CPU cores; resumable (runs already in runs.jsonl are skipped).
set -e
cd "$(dirname "$0")/../../.."
flock /tmp/heavy.lock .venv/bin/python results/ragged/2026-12-06-answers/run.py --batches 8
.venv/bin/python results/ragged/2026-12-06-answers/run.py --report > results/ragged/2026-12-06-answers/report.md
