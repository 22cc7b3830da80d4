"""The measuring tools: they import the method's modules at the root; nothing at the root imports them.

  bench.py, bench_kernels.py, bench_report.py, measure.py   decode steps, kernels alone, byte floors, their report
  table3.py, replay.py                                     Table 3 on a KV budget; one prefill replayed into many caches
  eval.py, eval_report.py, tasks.py, probe.py               accuracy: NIAH, RULER, perplexity, hit rates; task data
  baselines.py, baselines_bytes.py, baselines_prefill.py    the kvpress presses and QuantizedCache (their own venv)
  baselines_grid.py                                        their grid beside the project's caches, its report
  triton_aot.py                                            the compile gate and the static kernel report (no GPU)
  gpu_check.py                                             `make gpu-check`: the CUDA tests, kernels and steps
  figures.py                                               the docs' figures from results/
"""
