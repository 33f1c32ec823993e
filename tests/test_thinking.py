"""nodes.link.thinking: a thinking model's thinking tokens counted as they come (shared by the head and the node)."""

from nodes.link.thinking import ThinkingTokens


def counted(*batches: list[str]) -> int:
    count = ThinkingTokens()
    for pieces in batches:
        count.feed(pieces)
    return count.count


def test_thinking_tokens_run_from_the_opening_tag_through_the_one_that_closes_it():
    assert counted(["\n", "<", "think", ">", "Hm", "."], ["</", "think", ">", "\n\n", "Yes", "."]) == 9
    assert counted(["<think>", "Hm", "</think>"], ["Yes"]) == 3  # Qwen3's tags are tokens of their own


def test_a_thinking_cut_short_is_all_thinking_and_an_answer_that_does_not_open_with_the_tag_none():
    assert counted(["<think>", "Hm", ", let", " me see"]) == 4
    assert counted(["<th", "ought>", "Hi"]) == 0
    assert counted(["Hi", " <think>", "no", "</think>"]) == 0
    assert counted([" ", "\n"]) == 0 and counted(["<thi"]) == 0  # white space alone, or a tag never finished
