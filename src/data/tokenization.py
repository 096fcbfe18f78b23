"""Tokenizers built offline, and loading the model's tokenizer from a path or an object.

`byte_level_tokenizer` is the tokenizer of the tiny models and of the tests: one token per UTF-8
byte (ids 0-255 are the byte values) plus `<eos>` (256), `<pad>` (257) and `<bos>` (258). It adds
no special token on its own (`tokenizer(text)["input_ids"]` are exactly the text's bytes), so a
byte-tokenised document is as long as its UTF-8 encoding and character offsets of ASCII text are
token positions.

`train_bpe_tokenizer` trains a small byte-level BPE (GPT-2 style, the same family as Llama 3's
tokenizer) with the `tokenizers` library, for benchmarks and tiny models that want realistic
token lengths without the hub.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS_TOKEN = "<eos>"
PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
NUM_BYTES = 256
#: ids of `byte_level_tokenizer`: bytes 0-255, then the specials in this order
BYTE_EOS_ID, BYTE_PAD_ID, BYTE_BOS_ID = 256, 257, 258
BYTE_VOCAB_SIZE = 259


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    The `tokenizers` ByteLevel pre-tokenizer turns each byte of the input into this character, so
    a vocabulary keyed by these characters is a vocabulary of bytes.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(NUM_BYTES):
        if b not in printable:
            printable.append(b)
            chars.append(NUM_BYTES + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def byte_level_tokenizer(save_dir: str | os.PathLike | None = None) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: ids 0-255 are bytes, then `<eos>`=256, `<pad>`=257, `<bos>`=258.

    Built offline with `tokenizers` (a BPE model without merges over the byte alphabet), so it
    has offsets, batch encoding and `save_pretrained`; `AutoTokenizer.from_pretrained(save_dir)`
    loads it back. No special token is added when encoding.

    Args:
        save_dir: if given, the tokenizer is also saved there with `save_pretrained`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN, PAD_TOKEN, BOS_TOKEN])  # ids 256, 257, 258
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN
    )
    assert (hf_tok.eos_token_id, hf_tok.pad_token_id, hf_tok.bos_token_id) == (
        BYTE_EOS_ID, BYTE_PAD_ID, BYTE_BOS_ID) and len(hf_tok) == BYTE_VOCAB_SIZE
    if save_dir is not None:
        hf_tok.save_pretrained(str(save_dir))
    return hf_tok


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 8192,
    save_dir: str | os.PathLike | None = None,
    min_frequency: int = 2,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (GPT-2 / Llama-3 family) on `texts`, offline.

    Special tokens `<eos>`, `<pad>`, `<bos>` come first (ids 0, 1, 2); nothing is added when
    encoding. Training on a few MB of text takes seconds.

    Args:
        texts: training corpus, one document per item.
        vocab_size: size of the vocabulary including the 256 bytes and the specials.
        save_dir: if given, the tokenizer is also saved there with `save_pretrained`.
        min_frequency: minimum pair count for a merge.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < NUM_BYTES + 3:
        raise ValueError(
            f"vocab_size={vocab_size!r} must be at least {NUM_BYTES + 3} (bytes + 3 specials)"
        )
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN, PAD_TOKEN, BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN
    )
    if save_dir is not None:
        hf_tok.save_pretrained(str(save_dir))
    return hf_tok


def load_tokenizer(
    tokenizer: str | os.PathLike | PreTrainedTokenizerBase,
) -> PreTrainedTokenizerBase:
    """Return `tokenizer` itself, or load it with `AutoTokenizer.from_pretrained` from a path/id."""
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    if isinstance(tokenizer, (str, Path, os.PathLike)):
        try:
            return AutoTokenizer.from_pretrained(str(tokenizer))
        except OSError:
            raise  # not found: transformers' message names the path or id
        except Exception as err:  # a damaged file: the error names neither it nor the tokenizer
            raise ValueError(unreadable_tokenizer(tokenizer, err)) from err
    raise TypeError(
        "tokenizer must be a path, a hub id or a PreTrainedTokenizerBase, "
        f"got {type(tokenizer).__name__}"
    )


def eos_token_id(tokenizer: PreTrainedTokenizerBase, override: int | None = None) -> int:
    """The id that ends each document in a packed stream; raises if the tokenizer has none."""
    if override is not None:
        if not isinstance(override, int) or override < 0:
            raise ValueError(f"eos_token_id={override!r} must be a non-negative int")
        return override
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '')!r}) "
            "has no EOS token, which separates documents in packed sequences: set "
            "`tokenizer.eos_token` (or pass "
            "`eos_token_id=` to `packed_sequences`)"
        )
    return int(eos)


def pad_token_id(tokenizer: PreTrainedTokenizerBase, eos_id: int) -> int:
    """The id written in padded positions (masked out anyway): the pad token, else EOS."""
    pad = tokenizer.pad_token_id
    return int(pad) if pad is not None else eos_id


#: the files of a saved tokenizer, the one read first first
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model")


def unreadable_tokenizer(tokenizer: str | os.PathLike, err: BaseException) -> str:
    """The message for a tokenizer that exists but cannot be loaded: which file is at fault
    (the first of its JSON files that does not parse, else ``tokenizer.json``) and what to do."""
    import json

    where = Path(tokenizer).expanduser()
    culprit = None
    if where.is_dir():
        present = [where / f for f in _TOKENIZER_FILES if (where / f).is_file()]
        for f in present:
            if f.suffix == ".json":
                try:
                    json.loads(f.read_text())
                except (ValueError, UnicodeDecodeError):
                    culprit = f
                    break
        if culprit is None and present:
            culprit = present[0]
    what = f"{str(culprit)!r} is damaged or not a tokenizer file" if culprit else \
        "its files are damaged"
    reason = (str(err).splitlines() or [""])[0][:200]
    return (f"cannot load the tokenizer {str(tokenizer)!r}: {what} ({type(err).__name__}: "
            f"{reason}); restore it (save the tokenizer again with save_pretrained) or point "
            "tokenizer at another one")
