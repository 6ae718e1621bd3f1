"""Whether a draft speaks the target's tokens, told before any build, naming what differs.

Speculative decoding hands token ids from the draft to the target: the pair must share one vocabulary, id for id
(``build.check_same_tokenizer`` stops a build whose pair does not, after minutes of loading). Here the two files'
tokenizers are compared from their metadata alone, and a refusal says what differs: the tokenizer's kind, the
vocabulary's size, the tokens at the first ids that differ, the BPE merges, the special tokens that end or begin a
text. A GGUF carries its tokenizer as ``tokenizer.ggml.*`` fields; a checkpoint folder as tokenizer files, read
with transformers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ssd_trt.errors import ConfigError
from ssd_trt.models.sources import ResolvedSource

SHOWN = 3     # differing tokens quoted in a refusal; the rest are counted


@dataclass(frozen=True)
class TokenizerFacts:
    """A tokenizer as ids and strings. ``merges``/``model``: None where the source does not say (then not compared)."""
    tokens: tuple[str, ...]                   # tokens[i]: the text of id i
    special: dict[str, int | None] = field(default_factory=dict)   # bos / eos token ids
    merges: tuple[str, ...] | None = None
    model: str | None = None                  # gpt2 (byte-level BPE), llama (SentencePiece), ...


def _field(reader, key: str):
    found = reader.fields.get(key)
    return None if found is None else found.contents()


def gguf_tokenizer(reader) -> TokenizerFacts:
    """The tokenizer of a GGUF file (an open ``gguf.GGUFReader``)."""
    merges = _field(reader, "tokenizer.ggml.merges")
    return TokenizerFacts(tokens=tuple(_field(reader, "tokenizer.ggml.tokens") or ()),
                          special={name: _field(reader, f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos")},
                          merges=None if merges is None else tuple(merges),
                          model=_field(reader, "tokenizer.ggml.model"))


def hf_tokenizer(source: ResolvedSource) -> TokenizerFacts:
    """The tokenizer of a checkpoint folder, as transformers loads it (added tokens included)."""
    from ssd_trt.models.loading import load_tokenizer
    tokenizer = load_tokenizer(source)
    vocab = tokenizer.get_vocab()
    tokens = [""] * (max(vocab.values()) + 1 if vocab else 0)
    for text, index in vocab.items():
        tokens[index] = text
    return TokenizerFacts(tokens=tuple(tokens),
                          special={"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id})


def differences(target: TokenizerFacts, draft: TokenizerFacts) -> list[str]:
    """What differs between the two tokenizers, each as a phrase (empty: the same tokenizer)."""
    found = []
    if target.model and draft.model and target.model != draft.model:
        found.append(f"the tokenizer kind ({draft.model!r} vs {target.model!r})")
    if len(target.tokens) != len(draft.tokens):
        found.append(f"the vocabulary size ({len(draft.tokens)} vs {len(target.tokens)} tokens)")
    differing = [i for i, (a, b) in enumerate(zip(draft.tokens, target.tokens)) if a != b]
    if differing:
        shown = ", ".join(f"id {i}: {draft.tokens[i]!r} vs {target.tokens[i]!r}" for i in differing[:SHOWN])
        more = f" and {len(differing) - SHOWN} more" if len(differing) > SHOWN else ""
        found.append(f"the tokens at {len(differing)} ids ({shown}{more})")
    if target.merges is not None and draft.merges is not None and target.merges != draft.merges:
        first = next((i for i, (a, b) in enumerate(zip(draft.merges, target.merges)) if a != b),
                     min(len(draft.merges), len(target.merges)))
        found.append(f"the BPE merges ({len(draft.merges)} vs {len(target.merges)}, first different at merge {first})")
    for name in sorted(set(target.special) | set(draft.special)):
        ours, theirs = draft.special.get(name), target.special.get(name)
        if ours is not None and theirs is not None and ours != theirs:
            found.append(f"the {name} token id ({ours} vs {theirs})")
    return found


def require_shared_tokenizer(target: TokenizerFacts, draft: TokenizerFacts, target_rows: int, draft_rows: int,
                         draft_path: str) -> None:
    """A ConfigError, one line, when the draft's tokenizer (or the vocabulary its weights cover) is not the target's."""
    found = differences(target, draft)
    if target_rows != draft_rows:
        found.append(f"the embedding rows ({draft_rows} vs {target_rows})")
    if found:
        raise ConfigError(f"the draft {draft_path} does not share the target's tokenizer (draft vs target: "
                          f"{'; '.join(found)}); speculative decoding needs a draft made with the target's tokenizer, "
                          f"such as a smaller model of the same family")
