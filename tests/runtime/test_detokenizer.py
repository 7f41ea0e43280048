"""Incremental detokenization: whole characters only, same text as a full decode."""

from runtime.detokenizer import IncrementalDetokenizer
from runtime.tokenizer import ByteTokenizer, HFTokenizer


def _stream(tokenizer, prompt_ids, output_ids):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces = []
    for token_id in output_ids:
        detok.append(token_id)
        pieces.append(detok.take_new_text(finished=False))
    detok.flush()
    pieces.append(detok.take_new_text(finished=True))
    return pieces


def test_byte_fallback_characters_are_never_split(stories_dir):
    tokenizer = HFTokenizer(stories_dir)
    text = "Café au lait — naïve 😀 end"
    ids = tokenizer.encode(text)
    assert any(3 <= i <= 258 for i in ids)  # byte-fallback tokens are in play
    pieces = _stream(tokenizer, ids[:1], ids[1:])
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)


def test_leading_space_of_the_first_output_token_is_kept(stories_dir, golden):
    tokenizer = HFTokenizer(stories_dir)
    case = golden["cases"][1]
    pieces = _stream(tokenizer, case["prompt_ids"], case["greedy_30_new_ids"])
    assert case["prompt"] + "".join(pieces) == case["text"]


def test_byte_tokenizer_holds_partial_utf8():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("é✓", add_special_tokens=False)  # 2 + 3 bytes
    pieces = _stream(tokenizer, [tokenizer.bos_token_id], ids)
    assert pieces == ["", "é", "", "", "✓", ""]


def test_incomplete_bytes_at_the_end_are_flushed():
    tokenizer = ByteTokenizer()
    pieces = _stream(tokenizer, [256], [0x61, 0xE2, 0x9C])  # "a" then 2 of 3 bytes of ✓
    assert "".join(pieces) == "a\ufffd"
