"""Pure helpers: incremental text with stop strings, n-gram tables, prompt-lookup matching, rank templates."""

from __future__ import annotations

from specdecode.drafters.ngram_table import NgramTable
from specdecode.drafters.pld import find_continuations
from specdecode.drafters.token_recycling import rank_template
from specdecode.text import TextAssembler


class CharTokenizer:
    """Token i is chr(i); 0xFFFD stands for half of a multi-byte character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_text_is_released_when_final_and_cut_at_stop_strings():
    text = TextAssembler(CharTokenizer(), stop=["END"])
    assert text.add([ord("a"), ord("b")]) == "ab"
    assert text.add([ord("E")]) == ""  # could be the start of "END"
    assert text.add([ord("x")]) == "Ex"  # it was not
    assert text.add([ord("E"), ord("N")]) == ""
    assert text.add([ord("D"), ord("z")]) == "" and text.stopped
    assert text.released == "abEx"
    assert text.flush() == ""


def test_incomplete_characters_are_held_back():
    text = TextAssembler(CharTokenizer())
    assert text.add([ord("a"), 0xFFFD]) == ""
    assert text.add([ord("b")]) == "a\ufffdb"
    assert text.flush() == ""


def test_ngram_table_prefers_longer_keys_and_recent_continuations():
    table = NgramTable(key_lengths=(2, 1), length=2, per_key=2)
    seq = [1, 2, 3, 4, 9, 2, 5, 6, 1, 2, 7, 8]
    table.extend(seq[:6])
    table.extend(seq)  # incremental: only new n-grams are added
    assert table.lookup([0, 1, 2], 3) == [[7, 8], [3, 4], [5, 6]]
    assert table.lookup([9, 9], 3) == [[2, 5]]
    assert table.lookup([42], 3) == []


def test_ngram_table_forgets_least_recent_beyond_its_cap():
    table = NgramTable(key_lengths=(1,), length=1, per_key=2)
    table.add_sequence([5, 1, 5, 2, 5, 3, 5, 0])
    assert table.lookup([5], 5) == [[0], [3]]


def test_prompt_lookup_finds_recent_matches_first():
    ctx = [1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    assert find_continuations(ctx, 3, 1, 2, 1) == [[8, 7]]
    assert find_continuations(ctx, 3, 1, 2, 3) == [[8, 7], [9, 1]]
    assert find_continuations([4, 5, 6], 3, 1, 4, 2) == []


def test_rank_template_is_parents_first_within_the_rank_budget():
    paths = rank_template((2, 2, 1), 1)
    assert paths == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0)]
    assert all(p[:-1] in paths or len(p) == 1 for p in paths)


def test_prompts_for_a_base_model_are_its_plain_text():
    """Training, tuning and benchmark prompts for a model without a chat template (Gemma 3 270M): the turns' text."""
    from conftest import TARGET_TEXTS, bpe_tokenizer
    from specdecode.text import prompt_ids

    tokenizer = bpe_tokenizer(TARGET_TEXTS, 64)
    assert not tokenizer.chat_template
    messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}]
    assert prompt_ids(tokenizer, messages) == tokenizer("the cat\n\nsat\n\n")["input_ids"]
