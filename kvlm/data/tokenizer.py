"""Tokenizers: a byte-level BPE trained on the corpus, or GPT-2's files, behind one small wrapper.

Both are byte-level (GPT-2's scheme: every byte maps to a printable symbol before BPE), so any text
round-trips exactly: decode(encode(text)) == text. Documents are separated by one end-of-text token,
"<|endoftext|>" (GPT-2's id 50256; id 0 in a BPE trained here).

Special tokens in text: ``encode`` reads its input as ordinary text, so a literal "<|endoftext|>" inside a
document encodes to the byte-level pieces of those 13 characters, never to the end-of-text id. A document
therefore cannot inject a document boundary: the only end-of-text ids in prepared data are the ones
``kvlm prepare`` appends after each document. This is GPT-2 training practice (tiktoken's ``encode`` disallows
special tokens in raw text); Hugging Face tokenizers, which match special tokens by default, differ here, and
``encode(text, allow_special=True)`` gives their behaviour where a caller writes the marker on purpose.

Long text. The tokenizers library is superlinear on one huge string (offsets over the whole string: a 2 MB line
took seconds to pre-tokenize, 1.7 GB to encode at 8.9 MB), and BPE training is quadratic in the length of one
pre-token (a 4 MB word without whitespace ran past 10 minutes). So a BPE trained here splits runs of more than
``MAX_PRETOKEN_CHARS`` non-space (or space) characters into pieces of that length (no ordinary word is that
long, so ordinary text tokenizes as before), and text longer than ``PIECE_CHARS`` is handed to the library in
pieces cut where a pre-token starts (before a whitespace character that precedes text), which gives the same
ids as the whole; ``encode_pieces`` yields them so that a caller can stop early (``kvlm prepare --max-tokens``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

EOS_TOKEN = "<|endoftext|>"
MAX_PRETOKEN_CHARS = (
    128  # longest pre-token of a BPE trained here (a URL, a base64 blob is cut; a word is not)
)
PIECE_CHARS = 1 << 16  # text longer than this goes to the tokenizers library in pieces
_PIECE_CUT = re.compile(r"\s(?=\S)")  # a whitespace character followed by text: where a pre-token starts


class TokenizerError(ValueError):
    """A tokenizer file or folder that is missing, unreadable, or lacks the end-of-text token."""


class Tokenizer:
    """A tokenizers.Tokenizer (``.backend``) with the few calls kvlm needs."""

    def __init__(
        self, backend, eos_token: str = EOS_TOKEN, kind: str = "bpe", stop_tokens: Iterable[str] = ()
    ):
        self.backend = backend
        self.eos_token = eos_token
        self.kind = kind
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            raise TokenizerError(f"tokenizer has no end-of-text token {eos_token!r}")
        self.eos_id: int = eos_id
        # the tokens a model declares as ending its output (a chat model's end-of-turn <|im_end|> besides the
        # document end <|endoftext|>): generate and the serve engine stop at any of them
        self.stop_tokens: list[str] = list(dict.fromkeys([eos_token, *stop_tokens]))
        missing = [t for t in self.stop_tokens if backend.token_to_id(t) is None]
        if missing:
            raise TokenizerError(f"tokenizer has no stop token {missing[0]!r}")
        self._text_encoder = None  # built on first use by _encoder

    @property
    def stop_ids(self) -> list[int]:
        """Ids of ``stop_tokens``, the end-of-text id first."""
        return [self.backend.token_to_id(t) for t in self.stop_tokens]

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _encoder(self, allow_special: bool):
        """The backend that encodes: as is (special tokens matched), or a copy of it that reads special tokens
        as ordinary text (``encode_special_tokens``; a copy, so the backend handed to others is unchanged)."""
        if allow_special:
            return self.backend
        if self._text_encoder is None:
            self._text_encoder = HFTokenizer.from_str(self.backend.to_str())
            self._text_encoder.encode_special_tokens = True
        return self._text_encoder

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; a literal special token is ordinary text unless ``allow_special``."""
        if len(text) <= PIECE_CHARS:
            return self._encoder(allow_special).encode(text, add_special_tokens=False).ids
        return [i for ids in self.encode_pieces(text, allow_special) for i in ids]

    def encode_pieces(self, text: str, allow_special: bool = False) -> Iterator[list[int]]:
        """The ids of ``text`` piece by piece (``text_pieces``); joined, they are ``encode(text)``."""
        enc = self._encoder(allow_special)
        for piece in text_pieces(text):
            yield enc.encode(piece, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], allow_special: bool = False) -> list[list[int]]:
        enc = self._encoder(allow_special)
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets we do not use
        encode = getattr(enc, "encode_batch_fast", enc.encode_batch)
        if all(len(t) <= PIECE_CHARS for t in texts):
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        pieces, owner = [], []
        for n, text in enumerate(texts):
            for piece in text_pieces(text):
                pieces.append(piece)
                owner.append(n)
        out: list[list[int]] = [[] for _ in texts]
        for n, e in zip(owner, encode(pieces, add_special_tokens=False)):
            out[n].extend(e.ids)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self.backend.to_str()

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def save(self, path: str | Path) -> Path:
        """Writes tokenizer.json (into `path` if it is a folder)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path))
        return path

    def __repr__(self) -> str:
        stops = f", stop_ids={self.stop_ids}" if len(self.stop_tokens) > 1 else ""
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}{stops})"


def text_pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """``text`` in pieces of at most ``size`` characters, each cut (where one is near) before a whitespace
    character that precedes text: GPT-2's pre-tokenizer starts a pre-token there, so the pieces' pre-tokens are
    the whole text's. A run of ``size`` characters without such a place (one huge word) is cut at a multiple of
    ``MAX_PRETOKEN_CHARS`` from the run's start, where a BPE trained here splits it anyway."""
    pos, n = 0, len(text)
    run_start = (
        0  # start of the run (of spaces or of non-spaces) that holds text[pos], once a cut fell inside one
    )
    while n - pos > size:
        end = pos + size
        cut = None
        for m in _PIECE_CUT.finditer(text, pos + size // 2, end):
            cut = m.start()
        if cut is None:
            # the run holding text[end - 1]: scanned back to its start, or it began at or before pos
            space = text[end - 1].isspace()
            r = end - 1
            while r > pos and text[r - 1].isspace() == space:
                r -= 1
            if r == pos:
                r = min(run_start, pos) if text[pos].isspace() == space else pos
            cut = r + (end - r) // MAX_PRETOKEN_CHARS * MAX_PRETOKEN_CHARS
            if cut <= pos:
                cut = end
            run_start = r
        yield text[pos:cut]
        pos = cut
    if pos < n or n == 0:
        yield text[pos:]


def _byte_level(model, bounded: bool = False):
    tok = HFTokenizer(model)
    # add_prefix_space=False keeps the text unchanged, so decoding gives back exactly the input
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if bounded:  # runs longer than MAX_PRETOKEN_CHARS become several pre-tokens (see the module docstring)
        run = MAX_PRETOKEN_CHARS
        split = pre_tokenizers.Split(Regex(rf"\S{{{run}}}|\s{{{run}}}"), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int = 4096, eos_token: str = EOS_TOKEN) -> Tokenizer:
    """Train a byte-level BPE of (at most) `vocab_size` tokens, including the 256 byte symbols and the
    end-of-text token. A small corpus can run out of merges first: then the vocabulary is smaller."""
    if vocab_size < 257:
        raise TokenizerError(
            f"vocab_size={vocab_size} is too small: byte-level BPE needs 256 bytes + end-of-text"
        )
    tok = _byte_level(models.BPE(), bounded=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((piece for text in texts for piece in text_pieces(text)), trainer=trainer)
    return Tokenizer(tok, eos_token, kind="bpe")


def gpt2_tokenizer(folder: str | Path = "gpt2") -> Tokenizer:
    """GPT-2's BPE from a folder with vocab.json and merges.txt (or tokenizer.json). The name "gpt2"
    (no such folder) fetches GPT-2's tokenizer from the Hugging Face hub, which needs a network."""
    path = Path(folder)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        tok = load_tokenizer(path / "tokenizer.json")
        tok.kind = "gpt2"
        return tok
    if path.is_dir():
        vocab, merges = path / "vocab.json", path / "merges.txt"
        for f in (vocab, merges):
            if not f.is_file():
                raise TokenizerError(f"{path} is not a GPT-2 tokenizer folder: {f.name} is missing")
        try:
            model = models.BPE.from_file(str(vocab), str(merges))
        except Exception as e:  # the Rust side raises plain Exceptions
            raise TokenizerError(f"cannot read GPT-2 files in {path}: {e}") from e
        tok = _byte_level(model)
        tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
        return Tokenizer(tok, EOS_TOKEN, kind="gpt2")
    if str(folder) == "gpt2":
        try:
            return Tokenizer(HFTokenizer.from_pretrained("gpt2"), EOS_TOKEN, kind="gpt2")
        except Exception as e:
            raise TokenizerError(
                f"cannot download GPT-2's tokenizer ({e}); pass a folder with vocab.json and merges.txt"
            ) from e
    raise TokenizerError(f"no GPT-2 tokenizer folder at {path}")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """tokenizer.json (or a folder holding it, or a folder with GPT-2's vocab.json + merges.txt)."""
    path = Path(path)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        elif (path / "vocab.json").is_file():
            return gpt2_tokenizer(path)
        else:
            raise TokenizerError(f"{path} holds no tokenizer.json (nor vocab.json + merges.txt)")
    if not path.is_file():
        raise TokenizerError(f"no tokenizer at {path}")
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as e:
        raise TokenizerError(f"cannot read tokenizer {path}: {e}") from e
    vocab = backend.get_vocab(with_added_tokens=True)
    kind = "gpt2" if vocab.get(EOS_TOKEN) == 50256 and backend.get_vocab_size() == 50257 else "bpe"
    eos = EOS_TOKEN if EOS_TOKEN in vocab else None
    stops = declared_stop_tokens(path.parent, backend)
    if eos is None and stops:  # a model without <|endoftext|> (Llama's </s>): its declared eos ends documents
        eos = stops[0]
    return Tokenizer(backend, eos or EOS_TOKEN, kind=kind, stop_tokens=stops)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict {"content": ...}
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def end_of_turn_tokens(chat_template, special_tokens: Iterable[str]) -> list[str]:
    """The special tokens a chat template writes that end a turn or a text (``<|im_end|>``, ``<|eot_id|>``,
    ``<end_of_turn>``, ``<|end|>``): a chat model emits one when its reply is done, so generation stops there.
    transformers leaves this to generation_config.json, which GGUF files and many exports lack."""
    if isinstance(chat_template, dict):  # named templates
        chat_template = "\n".join(str(t) for t in chat_template.values())
    if not isinstance(chat_template, str) or not chat_template:
        return []
    out = []
    for token in special_tokens:
        low = token.lower()
        # not <|start_header_id|> / <|end_header_id|>: Llama-3's role header markers, inside a turn
        if (
            token in chat_template
            and ("end" in low or "eot" in low)
            and not ("start" in low or "header" in low)
        ):
            out.append(token)
    return out


def declared_stop_tokens(folder: str | Path, backend) -> list[str]:
    """The tokens that end generation as the files beside a tokenizer.json declare them, first the eos:
    a kvlm checkpoint's meta.json (``hf_tokenizer``: ``stop_tokens``, ``eos_token``, kept by ``kvlm import-hf``)
    or a Hugging Face folder's tokenizer_config.json (``eos_token``, the chat template's end-of-turn token) and
    generation_config.json (``eos_token_id``, an id or a list). Ids or names the vocabulary lacks are skipped."""
    folder = Path(folder)
    names: list[str] = []
    meta = _read_json(folder / "meta.json")
    settings = meta.get("hf_tokenizer") if meta.get("format") == "kvlm-checkpoint" else None
    if isinstance(settings, dict):
        names += [_token_text(settings.get("eos_token"))]
        names += [t for t in settings.get("stop_tokens") or [] if isinstance(t, str)]
    config = _read_json(folder / "tokenizer_config.json")
    names.append(_token_text(config.get("eos_token")))
    generation = _read_json(folder / "generation_config.json")
    ids = generation.get("eos_token_id")
    for i in ids if isinstance(ids, list) else [ids]:
        if isinstance(i, int) and not isinstance(i, bool):
            names.append(backend.id_to_token(i))
    template = config.get("chat_template")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    special = [t.content for t in backend.get_added_tokens_decoder().values() if t.special]
    names += end_of_turn_tokens(template, special)
    return [t for t in dict.fromkeys(names) if t is not None and backend.token_to_id(t) is not None]


def tokenizer_from_spec(
    spec: str | Path, texts: Iterable[str] | None = None, vocab_size: int = 4096
) -> Tokenizer:
    """`spec`: "bpe" (train on `texts`), "gpt2" or a path (tokenizer.json or a GPT-2 folder)."""
    if str(spec) == "bpe":
        if texts is None:
            raise TokenizerError("training a BPE needs texts")
        return train_bpe(texts, vocab_size)
    if str(spec) == "gpt2":
        return gpt2_tokenizer("gpt2")
    return load_tokenizer(spec)


def describe(tok: Tokenizer) -> dict:
    return {"kind": tok.kind, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "sha256": tok.sha256()}


__all__ = [
    "EOS_TOKEN",
    "Tokenizer",
    "TokenizerError",
    "declared_stop_tokens",
    "describe",
    "end_of_turn_tokens",
    "gpt2_tokenizer",
    "load_tokenizer",
    "train_bpe",
    "tokenizer_from_spec",
]
