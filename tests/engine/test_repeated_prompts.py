"""A prompt sent again reuses all of it the prefix cache can give, and one that extends an
earlier prompt reuses that prompt less at most one page (step_builder.row_plan: the last
chunk of a prompt ending on a page boundary snapshots one page before its end)."""

import numpy as np
import pytest

from tests.engine.driver import Driver

# (page size, chunk, prompt length): on a page boundary with a last chunk of several
# pages, of exactly one page, a single chunk, a single page; and off a page boundary.
CASES = [
    (16, 64, 128),
    (16, 64, 80),
    (16, 64, 64),
    (16, 64, 16),
    (16, 64, 120),
    (16, 64, 200),
    (1, 8, 20),
    (1, 8, 7),
]


def prompt_of(length: int) -> list[int]:
    return (np.arange(length) * 7 % 251 + 1).tolist()


@pytest.mark.parametrize(("page_size", "chunk", "length"), CASES)
@pytest.mark.parametrize("max_new", [1, 12])
def test_a_repeated_prompt_reuses_all_but_its_last_partial_or_whole_page(
    page_size, chunk, length, max_new
):
    d = Driver(page_size=page_size, chunk=chunk)
    first = d.generate(prompt_of(length), max_new)
    d.run()
    again = d.generate(prompt_of(length), max_new)
    d.run()
    # A match is page-aligned and leaves at least one token to compute.
    assert again.cached_tokens == (length - 1) // page_size * page_size
    assert again.cached_tokens >= length - page_size
    assert again.output == first.output
    d.assert_idle_clean()


@pytest.mark.parametrize(("page_size", "chunk", "length"), CASES)
@pytest.mark.parametrize("extra", [1, 21])
def test_an_extending_prompt_reuses_the_shared_prompt_less_one_page_at_most(
    page_size, chunk, length, extra
):
    d = Driver(page_size=page_size, chunk=chunk)
    d.generate(prompt_of(length), 4)
    d.run()
    longer = [*prompt_of(length), *range(1, extra + 1)]
    ext = d.generate(longer, 6)
    d.run()
    assert length - page_size <= ext.cached_tokens <= length
    fresh = Driver(page_size=page_size, chunk=chunk)
    alone = fresh.generate(longer, 6)
    fresh.run()
    assert ext.output == alone.output
    d.assert_idle_clean()
