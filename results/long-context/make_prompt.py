"""A completion-form needle prompt of about LENGTH tokens of Gemma 3's tokenizer (the haystack of
tools/tasks.py with the needle at DEPTH, then "According to the text above, the best thing to do in
San Francisco is"), written to OUT: the prompt of the prefill timings in docs/long-context.md.

    python results/long-context/make_prompt.py --model checkpoints/gemma-3-270m --length 30099 --out /tmp/p30k.txt
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools import tasks  # noqa: E402

CUE = "According to the text above, the best thing to do in San Francisco is"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--length", type=int, default=30099)
    p.add_argument("--depth", type=float, default=0.5)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(a.model))
    n_tokens = lambda text: len(tok(text)["input_ids"])  # noqa: E731 (the BOS the tokenizer adds included)
    units = tasks.essay_units()

    def text(n_words):
        s = tasks.niah_sample(n_words, a.depth)
        return s.prompt.rsplit("\n\n", 1)[0] + "\n\n" + CUE

    lo, hi = 1, len(units)
    while lo < hi:  # the most words whose prompt fits the length
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if n_tokens(text(mid)) <= a.length else (lo, mid - 1)
    a.out.write_text(text(lo))
    print(f"{a.out}: {n_tokens(text(lo))} tokens")


if __name__ == "__main__":
    main()
